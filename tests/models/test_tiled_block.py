"""[mop.tiling] in the model: `debug`-sized decoders with their FFNs and attention's row-wise stages
over token tiles against the same model untiled, under per-block checkpointing (plain, SCO, and with
attention kept), the document mask, and Ulysses at sequence-group sizes 1-4 (gloo).

Losses and every gradient of a weight outside a tiled stage (embeddings, routers, routed experts, the
norms before the FFNs) must be bitwise the untiled ones: the tiled stages give bitwise outputs and
input gradients (tests/ops/test_tiling.py says when the CPU kernels allow it; the shapes here do).
The tiled stages' own weight gradients reorder an N-token sum in fp32 and must stay within the
summation bound of tests/ops/test_tiling.py. The bytes of a tiled block against models/memory.py.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mop_train.models import zoo
from mop_train.models.attention import rope_cos_sin, rope_inv_freq
from mop_train.models.document_mask import document_ids
from mop_train.models.keep_attention import keep_attention, kept_entries
from mop_train.models.memory import attention_stage_token_bytes
from mop_train.models.model import tile_blocks
from mop_train.ops.sco import SelectiveCheckpointOffload
from mop_train.ops.sco.reference import checkpointed
from mop_train.ops.tiling import tiled_rows
from mop_train.ops.tiling.function import _TiledRows
from mop_train.parallel.apply import apply_sequence_parallel
from tests.dist_utils import run_distributed
from tests.ops.test_tiling import MagnitudeSums, assert_weight_grad_within
from tests.utils import AllocatedBytes, assert_bitwise_equal, fresh_seed

EOS = 1
GQA = dict(attention="gqa", n_heads=4, n_kv_heads=2, head_dim=16)
TILED_FFN = ("feed_forward.", "shared_expert.")
TILED_BLOCK = ("attention_norm.", "attention.")


def _args(variant: str, **extra):
    debug = zoo.get_model_args("debug")
    return replace(debug, **{"gqa": GQA, "mla": {}, "mla-qlora": dict(q_lora_rank=24)}[variant], **extra)


def _prepared(base, tiles, wrap: str, keep: bool, seq_group=None):
    """A copy of `base`: Ulysses cores over `seq_group`, every block checkpointed ("plain", "sco") or
    not ("none"), attention kept or replayed, and tiles (ffn_tokens, block_tokens)."""
    model = copy.deepcopy(base)
    apply_sequence_parallel(model, seq_group)   # what the layout does (a no-op without a group)
    sco = SelectiveCheckpointOffload(1 << 20) if wrap == "sco" else None
    for name, block in list(model.layers.items()):
        if wrap != "none":
            model.layers.register_module(name, sco.wrap(block) if sco else checkpointed(block))
    keep_attention(model, keep)
    tile_blocks(model, *tiles)
    return model


def _tiled_nodes(loss) -> int:
    """_TiledRows nodes in the loss's graph (the tiled stages that ran)."""
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node) is _TiledRows._backward_cls
        stack.extend(n for n, _ in node.next_functions)
    return count


def _step(model, tokens, targets, doc_ids, positions=None):
    h = model(tokens, positions=positions, doc_ids=doc_ids)
    loss = F.cross_entropy(model.output(h).flatten(0, 1).float(), targets.flatten(), reduction="sum")
    nodes = _tiled_nodes(loss)
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, nodes


def _batch(gen, B, S, masked):
    tokens = torch.randint(2, 2048, (B, S), generator=gen)
    tokens[torch.rand(B, S, generator=gen) < 0.2] = EOS
    return tokens, torch.randint(0, 2048, (B, S), generator=gen), (document_ids(tokens, EOS) if masked else None)


def _compare(tiled, untiled, sums, tokens, tiles, tag):
    loss, grads, nodes = tiled
    want_loss, want, _ = untiled
    assert_bitwise_equal(loss, want_loss, name=f"{tag} loss")
    tiled_names = (TILED_FFN if tiles[0] else ()) + (TILED_BLOCK if tiles[1] else ())
    for name, g in want.items():
        if any(part in name for part in tiled_names):
            assert_weight_grad_within(grads[name], g, sums, tokens, f"{tag} {name}")
        else:
            assert_bitwise_equal(grads[name], g, name=f"{tag} {name}")


def _expected_nodes(model_args, tiles) -> int:
    ffns = model_args.n_dense_layers + (model_args.n_moe_layers if model_args.n_shared_experts else 0)
    return (ffns if tiles[0] else 0) + (2 * model_args.n_layers if tiles[1] else 0)


CASES = [  # variant, dtype, wrap, keep, masked, (ffn_tokens, block_tokens)
    ("mla", torch.float32, "plain", False, False, (26, 26)),
    ("mla-qlora", torch.bfloat16, "sco", False, True, (34, 30)),
    ("gqa", torch.bfloat16, "plain", True, False, (0, 24)),
    ("mla", torch.float32, "none", False, True, (24, 0)),
    ("gqa", torch.float32, "sco", True, True, (50, 40)),
]


@pytest.mark.parametrize("variant,dtype,wrap,keep,masked,tiles", CASES)
def test_tiled_model_equals_untiled(variant, dtype, wrap, keep, masked, tiles):
    torch.manual_seed(fresh_seed(3701))
    args = _args(variant)
    base = zoo.build_model(args, dtype=dtype)
    gen = torch.Generator().manual_seed(fresh_seed(3702))
    B, S = 2, 61                                                   # 122 tokens: tiles of >= 12 rows
    batch = _batch(gen, B, S, masked)
    with MagnitudeSums() as mags:
        untiled = _step(_prepared(base, (0, 0), wrap, keep), *batch)
    model = _prepared(base, tiles, wrap, keep)
    tiled = _step(model, *batch)
    assert tiled[2] == _expected_nodes(args, tiles), (tiled[2], tiles)
    assert kept_entries(model) == []
    _compare(tiled, untiled, mags.sums, B * S, tiles, f"{variant} {dtype} {wrap} keep={keep} masked={masked} {tiles}")


def test_tiles_at_or_above_the_tokens_run_untiled():
    """A tile of at least the block's tokens takes the plain path: no tiled node, bitwise everything."""
    torch.manual_seed(fresh_seed(3703))
    base = zoo.build_model(_args("mla"))
    batch = _batch(torch.Generator().manual_seed(fresh_seed(3704)), 2, 20, False)
    want = _step(_prepared(base, (0, 0), "plain", False), *batch)
    got = _step(_prepared(base, (40, 40), "plain", False), *batch)
    assert got[2] == 0
    assert_bitwise_equal(got[0], want[0], name="loss")
    for name in want[1]:
        assert_bitwise_equal(got[1][name], want[1][name], name=name)


def _ulysses_tiled(rank, world_size, seed):
    """Each rank: its sequence shard through Ulysses-wrapped cores; tiled vs untiled at the same D."""
    torch.manual_seed(seed)
    args = _args("mla", n_heads=12)                                # 12 heads split over D = 1..4
    base = zoo.build_model(args)
    B, S = 2, 48
    S_l = S // world_size
    sl = slice(rank * S_l, (rank + 1) * S_l)
    gen = torch.Generator().manual_seed(seed + 1)
    tiles = (12, 12)                                               # one thread per rank: >= 4 rows suffice
    for masked in (False, True):
        tokens, targets, doc_ids = _batch(gen, B, S, masked)
        shard = (tokens[:, sl], targets[:, sl], doc_ids, torch.arange(sl.start, sl.stop))
        with MagnitudeSums() as mags:
            untiled = _step(_prepared(base, (0, 0), "plain", True, dist.group.WORLD), *shard)
        tiled = _step(_prepared(base, tiles, "plain", True, dist.group.WORLD), *shard)
        assert tiled[2] == _expected_nodes(args, tiles)               # B * S/D >= 24 tokens > one tile
        _compare(tiled, untiled, mags.sums, B * S_l, tiles, f"rank {rank}/{world_size} masked={masked}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ulysses_tiled_equals_untiled(world_size):
    run_distributed(_ulysses_tiled, world_size, fresh_seed(3705))


@pytest.mark.parametrize("variant", ["mla-qlora", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_stage_bytes_per_tile_token(variant, dtype):
    """The input stage's backward grows by models.memory.attention_stage_token_bytes per tile token
    at most (and by at least half of it, so a term that vanishes shows)."""
    args = _args(variant)
    torch.manual_seed(fresh_seed(3706))
    att = zoo.build_model(args, dtype=dtype).layers["0"].attention
    norm = torch.nn.RMSNorm(args.dim, eps=args.norm_eps).to(dtype)
    N = 2048
    rope = rope_cos_sin(torch.arange(N), rope_inv_freq(args.rope_dim, args.rope_theta))
    x = torch.randn(1, N, args.dim).to(dtype).requires_grad_()
    weights = {"attention_norm": norm.weight, **att.projection_weights()}

    def stage(ops, s, rows, w):
        return att.project(ops, ops.rms_norm(rows[0], w["attention_norm"], norm.eps), rope[s], w)

    grads = [torch.randn(o.shape).to(dtype) for o in tiled_rows(stage, (x,), weights, N)]
    peaks = {}
    for tile in (256, 512):
        with AllocatedBytes() as seen:
            torch.autograd.backward(tiled_rows(stage, (x,), weights, tile), grads)
        peaks[tile] = seen.peak
    per_token = (peaks[512] - peaks[256]) / 256
    bound = attention_stage_token_bytes(args, torch.empty((), dtype=dtype).element_size())
    assert bound / 2 <= per_token <= bound, (variant, dtype, per_token, bound)


def test_compiled_blocks_run_the_tiles_eagerly():
    """[compile] with tiling: the tiled stages are graph breaks (ops.tiling.tiled_rows is
    compiler-disabled); the compiled (aot_eager) model's loss and gradients equal the eager one's."""
    from mop_train.parallel.compile import CompileOptions, apply_compile
    from mop_train.train.loss import LanguageModelLoss
    from tests.utils import assert_close_to_scale

    torch.manual_seed(fresh_seed(3707))
    eager = LanguageModelLoss(zoo.build_model(_args("mla")))
    compiled = copy.deepcopy(eager)
    for m in (eager, compiled):
        for name, block in list(m.model.layers.items()):
            m.model.layers.register_module(name, checkpointed(block))
        tile_blocks(m.model, 16, 16)
    torch._dynamo.reset()
    apply_compile(compiled, CompileOptions(model=True, loss=False, backend="aot_eager"), device_type="cpu")
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(fresh_seed(3708)))
    labels = torch.roll(tokens, -1, dims=1)
    runs = []
    for m in (eager, compiled):
        loss = m(tokens, labels)
        assert _tiled_nodes(loss) == _expected_nodes(m.model.args, (16, 16))
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert_close_to_scale(runs[1][0], runs[0][0], rtol=1e-6, name="loss")
    for name, grad in runs[0][1].items():
        assert_close_to_scale(runs[1][1][name], grad, rtol=1e-5, name=name)
