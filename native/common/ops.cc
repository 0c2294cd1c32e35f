#include "common/ops.h"

#include <cstring>
#include <sstream>

namespace strata {
namespace {

constexpr OpInfo kNone{Op::none, "", "", "", "", "", "", -1};
constexpr OpInfo kTable[] = {
#define STRATA_OP_ROW(id, api, lax, target, stats, algorithms, reduce) \
  {Op::id, #id, api, lax, target, stats, algorithms, reduce_code::reduce},
    STRATA_OPERATORS(STRATA_OP_ROW)
#undef STRATA_OP_ROW
};
constexpr int kCount = sizeof(kTable) / sizeof(kTable[0]);

constexpr const char* kTargetNames[] = {"",
#define STRATA_TARGET_NAME(target, handler) #target,
                                        STRATA_TARGETS(STRATA_TARGET_NAME)
#undef STRATA_TARGET_NAME
};

}  // namespace

const OpInfo* op_table(int* count) {
  *count = kCount;
  return kTable;
}

const OpInfo& op_info(Op op) {
  const int i = static_cast<int>(op);
  return i >= 1 && i <= kCount ? kTable[i - 1] : kNone;
}

Op op_of_reduce(int32_t reduce) {
  for (const OpInfo& r : kTable)
    if (r.reduce >= 0 && r.reduce == reduce) return r.op;
  return Op::none;
}

bool OpParams::operator==(const OpParams& o) const {
  return form == o.form && root == o.root && split_axis == o.split_axis &&
         concat_axis == o.concat_axis && divert_axis == o.divert_axis && move_to == o.move_to &&
         dimension == o.dimension && parts == o.parts && part == o.part && topk == o.topk &&
         weighted == o.weighted && push == o.push && max_tokens == o.max_tokens &&
         slices == o.slices && signature == o.signature;
}

std::string OpParams::describe() const {
  std::ostringstream os;
  const char* sep = "";
  auto field = [&](const char* name, int64_t v, int64_t unset) {
    if (v == unset) return;
    os << sep << name << " " << v;
    sep = ", ";
  };
  const int t = static_cast<int>(form);
  if (t > 0 && t < static_cast<int>(sizeof(kTargetNames) / sizeof(kTargetNames[0]))) {
    os << "form " << kTargetNames[t];
    sep = ", ";
  }
  field("root", root, -1);
  field("split_axis", split_axis, -1);
  field("concat_axis", concat_axis, -1);
  field("divert_axis", divert_axis, -1);
  field("move_to", move_to, -1);
  field("dimension", dimension, -1);
  field("parts", parts, 0);
  field("part", part, -1);
  field("topk", topk, 0);
  field("weighted", weighted, 0);
  field("push", push, 0);
  field("max_tokens", max_tokens, 0);
  field("slices", slices, 0);
  if (signature) {
    os << sep << "signature " << std::hex << signature << std::dec;
  }
  return os.str();
}

uint64_t OpParams::digest() const {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(static_cast<uint64_t>(form));
  for (int64_t v : {root, split_axis, concat_axis, divert_axis, move_to, dimension, parts, part,
                    topk, weighted, push, max_tokens, slices})
    mix(static_cast<uint64_t>(v));
  mix(signature);
  return h ? h : 1;
}

}  // namespace strata
