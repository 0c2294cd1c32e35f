// Metadata memory for the pool, taken straight from mmap (this folder runs inside malloc, so its
// own bookkeeping cannot call malloc): fixed-size objects from slabs (MetaArena) and the map from
// a user pointer to its block (PtrMap).
#ifndef STRATA_ALLOC_META_H_
#define STRATA_ALLOC_META_H_

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "alloc/internal.h"

#pragma GCC visibility push(hidden)
namespace strata::alloc {

// Zeroed, page-aligned memory; nullptr on failure.
inline void* MetaMap(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}
inline void MetaUnmap(void* p, size_t bytes) { munmap(p, bytes); }

// Fixed-size objects from mmap'd slabs, recycled through a free list. Never returned to the OS.
template <typename T>
struct MetaArena {
  struct Node {
    Node* next;
  };
  Node* free_list;
  T* Get() {
    if (!free_list) {
      constexpr size_t kSlab = 256 * 1024;
      char* slab = static_cast<char*>(MetaMap(kSlab));
      if (!slab) return nullptr;
      constexpr size_t kSz = sizeof(T) > sizeof(Node) ? sizeof(T) : sizeof(Node);
      for (size_t off = 0; off + kSz <= kSlab; off += kSz) {
        Node* n = reinterpret_cast<Node*>(slab + off);
        n->next = free_list;
        free_list = n;
      }
    }
    Node* n = free_list;
    free_list = n->next;
    T* t = reinterpret_cast<T*>(n);
    memset(static_cast<void*>(t), 0, sizeof(T));
    return t;
  }
  void Put(T* t) {
    Node* n = reinterpret_cast<Node*>(t);
    n->next = free_list;
    free_list = n;
  }
};

// user pointer -> allocated V*. Linear probing, backward-shift deletion, grows at 1/2 load.
template <typename V>
struct PtrMap {
  struct Slot {
    uintptr_t key;
    V* val;
  };
  Slot* slots;
  size_t cap;  // power of two (0 before first use)
  size_t count;

  static size_t Hash(uintptr_t k, size_t cap) {
    return static_cast<size_t>(((k >> 12) * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1);
  }
  bool Grow() {
    size_t ncap = cap ? cap * 2 : 1024;
    Slot* ns = static_cast<Slot*>(MetaMap(ncap * sizeof(Slot)));
    if (!ns) return false;
    for (size_t i = 0; i < cap; ++i) {
      if (!slots[i].key) continue;
      size_t j = Hash(slots[i].key, ncap);
      while (ns[j].key) j = (j + 1) & (ncap - 1);
      ns[j] = slots[i];
    }
    if (slots) MetaUnmap(slots, cap * sizeof(Slot));
    slots = ns;
    cap = ncap;
    return true;
  }
  bool Reserve() { return (count + 1) * 2 <= cap || Grow(); }
  void Insert(uintptr_t k, V* v) {  // after Reserve()
    size_t j = Hash(k, cap);
    while (slots[j].key) j = (j + 1) & (cap - 1);
    slots[j] = {k, v};
    ++count;
  }
  V* Find(uintptr_t k) const {
    if (!cap) return nullptr;
    for (size_t j = Hash(k, cap);; j = (j + 1) & (cap - 1)) {
      if (!slots[j].key) return nullptr;
      if (slots[j].key == k) return slots[j].val;
    }
  }
  void Erase(uintptr_t k) {
    size_t j = Hash(k, cap);
    while (slots[j].key != k) {
      if (!slots[j].key) return;
      j = (j + 1) & (cap - 1);
    }
    // Backward shift: move later members of the probe run into the hole when allowed.
    size_t hole = j;
    for (size_t i = (j + 1) & (cap - 1); slots[i].key; i = (i + 1) & (cap - 1)) {
      size_t home = Hash(slots[i].key, cap);
      bool movable = hole <= i ? (home <= hole || home > i) : (home <= hole && home > i);
      if (movable) {
        slots[hole] = slots[i];
        hole = i;
      }
    }
    slots[hole] = {0, nullptr};
    --count;
  }
};

}  // namespace strata::alloc
#pragma GCC visibility pop

#endif  // STRATA_ALLOC_META_H_
