"""Collectives whose group spans fabrics: strata inside each fabric, XLA's collectives between.

A group of a mesh axis (or tuple of axes) whose devices live in several fabric domains (see
``topology.py``) cannot meet in one shared-memory rendezvous: no fabric can map another's
memory. The split is decided at lowering time from the mesh's device assignment
(``device.process_index``) and the job's fabric map, so the program stays SPMD and the
primitives' autodiff/vmap rules are untouched (they live above the lowering).

Layout. Every group is cut by fabric into F *fabric slots* (ordered by first appearance in the
group) of L members each (ordered as in the group): group rank g sits at (f(g), l(g)). The
*intra* groups are one fabric slot of one group (L devices, one fabric: strata's path); the
*inter* groups are the members with equal l across the slots (F devices, one per fabric: XLA's
collective, gloo or MPI, over explicit replica groups with global device ids, as
``jax/_src/lax/parallel.py`` lowers ``psum``). A group whose fabrics hold different numbers of
its members, or whose layout differs between groups, and a group with one device per fabric,
lower straight to XLA's collective for the whole op.

Algorithms (NCCL's intra-node/inter-node split; DeepEP's NVLink aggregation before RDMA;
StrataCL's supernode/scale-out, Hu et al. 2026). Inter-fabric bytes are per device:
- all-reduce (psum/pmax/pmin): reduce-scatter inside the fabric (padded to a multiple of L) ->
  all-reduce of the 1/L shard across fabrics -> all-gather inside. Crosses S/L. With F = 2
  the all-reduce is one collective-permute of the shard with the partner (gloo's ring takes
  two rounds for the same bytes; measured faster, most below 4 MiB), then reduced with the
  own one inside the intra all_gather (strata's all_gather_reduce: above 512 KiB every
  member writes its reduced block straight into every peer's output; below, each reduces
  every member's published pair into its own output, which the low-latency path can run).
  From ONE_WAY_BYTES the shards cross along the two-fabric ring instead (one
  collective-permute, every connection one way), and a member's received shard is paired with
  the own fabric's shard of the same index, which another member may hold (x_from).
- all_gather: all-gather across fabrics of the own block first (F-1 blocks cross, not
  (F-1)*L), then inside the fabric, where each block is written straight to its place in
  group order (strata_all_gather_placed; no reorder pass). F = 2 from ONE_WAY_BYTES: the own
  fabric's blocks are gathered first, the own block crosses along the ring, and the blocks
  that crossed are gathered into the same output (strata_all_gather_part[_into]).
- psum_scatter: reduce-scatter inside, each member summing the F blocks of its local index
  where they lie (strata_psum_scatter_placed; no reorder pass), then reduce-scatter across
  fabrics (F = 2: the partner's block, which strata writes to a result of its own, by one
  collective-permute, reduced on arrival).
  Crosses (F-1)/F of S/L.
- all_to_all: the split axis viewed as [F, L*b] (free); all-to-all inside the fabric splitting
  the L*b part (a strided copy in strata, no transpose in XLA), so that each member holds
  everything its fabric sends to local index l, one aggregate per destination fabric; then
  one all-to-all across fabrics of those aggregates (F = 2: strata writes the partner fabric's
  aggregate to a buffer of its own, which crosses by one collective-permute; what comes back is
  written in place of it, S/2 copied once). Crosses (F-1)/F of S.
- ppermute: pairs inside a fabric through strata, pairs across through XLA's
  collective-permute; each destination takes the one that wrote it.
- pbroadcast: all-gather across fabrics among the source's local index, keep the source's
  fabric, then broadcast inside the fabric from the source's local index. Exact bits.

The intra steps run through :data:`group_collective_p` with ``engine="strata"``; the inter
steps with ``engine="xla"``, next to a custom call that counts the bytes handed over
(``comm_stats()["inter_fabric_bytes"]``).

The modules, one idea each: ``plan.py`` (how fabrics cut the groups), ``steps.py`` (one
collective over explicit groups, by strata or by XLA, and the two-fabric forms of strata's
calls), ``checks.py`` (ranks on different fabrics that disagree on a call fail before any byte
moves), ``algorithms.py`` (the algorithms above, and the hook of the collectives' lowering),
``moe.py`` (MoE dispatch/combine across fabrics).
"""

from strata_jax._src.hierarchy.algorithms import ONE_WAY_BYTES, lower_across_fabrics
from strata_jax._src.hierarchy.checks import ENV_CHECK, user_scope
from strata_jax._src.hierarchy.moe import lower_moe_across_fabrics
from strata_jax._src.hierarchy.plan import Plan, plan

__all__ = [
    "ENV_CHECK",
    "ONE_WAY_BYTES",
    "Plan",
    "lower_across_fabrics",
    "lower_moe_across_fabrics",
    "plan",
    "user_scope",
]
