// What concurrency XLA really gives strata calls on one device, recorded on every call.
//
// The cross-process rendezvous (fabric/shm.h) counts executions per (device, communicator),
// so it needs a device's executions not to overlap. XLA CPU launches a multi-device program
// only after the previous one finished on every device of the process ("schedule only one
// collective at a time": PjRtCpuLoadedExecutable waits on the client's last collective launch
// event, counted down when every device's execution ended). Inside one execution, though,
// independent strata calls do run at once (measured: 2 in flight on a device), which is why
// calls of one execution are told apart by op index, not by their start order. InFlight
// counts the calls and distinct executions (run ids) in flight per device on every call, keeps
// the maxima in stats() (strata_jax.comm_stats()), and lets the shared-memory fabric refuse a
// call that overlaps another execution's call on its device instead of risking a wrong pairing.
#pragma once

#include <cstdint>

namespace strata {

class InFlight {
 public:
  InFlight(int64_t device, int64_t run_id);
  ~InFlight();
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
  // Calls of this device in flight when this one started (this one included).
  int calls_at_entry() const { return calls_; }
  // Distinct executions with a call in flight on this device when this one started (>= 1).
  int runs_at_entry() const { return runs_; }

 private:
  int64_t device_, run_id_;
  int calls_ = 0, runs_ = 0;
};

}  // namespace strata
