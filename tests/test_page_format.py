"""Canonical KV pages (kvservice/integrations/vllm/connector/pageformat.py) on by-hand views of vLLM's layouts:
every layout saves and loads into every other, byte-exact against a naive per-block reference, and the engine's
own pool changes exactly where it should (a load into a copy of a view would leave it unchanged)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvservice.integrations.vllm.connector.pageformat import PageFormat
from tests.page_format_helpers import by_hand, check_round_trip, fill, gather, reference_page

MODELS = {  # heads, content, dtype (fp8 caches are uint8)
    "mha-bf16": (4, 64, torch.bfloat16),
    "mha-fp8": (4, 64, torch.uint8),
    "mla-bf16": (1, 576, torch.bfloat16),
}
VARIANTS = [("LBNHC", 1), ("LBNHC", 2), ("LBHNC", 1), ("LBHNC", 2), ("BLHNC", 1), ("BLNHC", 1)]
LAYERS, BLOCKS, BLOCK_SIZE = 11, 12, 16  # 11 layers: layers.10 sorts after layers.9
ID_PAIRS = [([7, 2, 9, 3], [1, 10, 5, 0]), ([4, 5, 6, 7], [8, 9, 10, 11])]


def engine(variant, model, raw=None):
    layout, ratio = variant
    heads, content, dtype = MODELS[model]
    return by_hand(layout, LAYERS, BLOCKS, heads, BLOCK_SIZE, content, dtype, ratio, raw=raw)


# every pair for MHA bf16; for fp8 and MLA each variant into itself and into the next
PAIRS = [("mha-bf16", a, b) for a, b in itertools.product(VARIANTS, VARIANTS)] + [
    (model, a, b) for model in ("mha-fp8", "mla-bf16") for a, b in zip(VARIANTS, VARIANTS[1:] + VARIANTS[:1])
] + [(model, a, a) for model in ("mha-fp8", "mla-bf16") for a in VARIANTS]


@pytest.mark.parametrize("model,src_variant,dst_variant", PAIRS)
def test_every_layout_loads_what_every_layout_saved(model, src_variant, dst_variant):
    for seed, (src_ids, dst_ids) in enumerate(ID_PAIRS):
        src, dst = engine(src_variant, model), engine(dst_variant, model)
        fill(src, seed)
        fill(dst, seed + 100)
        expected = engine(dst_variant, model, raw=dst.raw.clone())
        check_round_trip(src, dst, expected, src_ids, dst_ids)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_fast_path_equals_the_general_path(model, variant):
    src = engine(variant, model)
    fill(src, 1)
    fast, general = src.format(), src.format(fast=False)
    assert fast.format_id == general.format_id
    ids = [11, 0, 5, 6, 7, 3]
    pages = gather(fast, ids)
    assert torch.equal(pages, gather(general, ids))
    a, b = engine(variant, model), engine(variant, model)
    a.format().scatter(pages, [1, 2, 3, 9, 4, 8])
    b.format(fast=False).scatter(pages, [1, 2, 3, 9, 4, 8])
    assert torch.equal(a.raw, b.raw)


# (engine block ids, page rows): ascending, strided, descending, opposite ways, shuffled, mixed stretches
ID_ROWS = [([2, 3, 4, 5, 6], [0, 1, 2, 3, 4]), ([1, 3, 5, 7], [2, 4, 6, 8]), ([9, 8, 7, 6], [13, 12, 11, 10]),
           ([0, 1, 2, 3, 4], [10, 9, 8, 7, 6]), ([7, 2, 11, 0, 5, 9, 1, 10, 3, 8, 4, 6], [3, 12, 0, 7, 13, 1, 9, 4, 11,
                                                                                     2, 10, 5]),
           ([4, 5, 6, 11, 10, 9, 0], [0, 1, 2, 3, 4, 5, 13])]
CPU_MODELS = {"cpu-fp32": torch.float32, "cpu-bf16": torch.bfloat16, "cpu-fp16": torch.float16, "cpu-fp8": torch.uint8}


def cpu_engine(dtype, raw=None):
    return by_hand("LBHNC", LAYERS, BLOCKS, 2, 32, 2 * 24, dtype, raw=raw)


def formats(e, model: str):
    """The connector's copy and the reference (the per-element path: one copy per layer, in bytes, by index)."""
    kw = dict(cpu_isa="vec", head_size=24) if model.startswith("cpu") else {}
    return e.format(**kw), e.format(fast=False, **kw)


@pytest.mark.parametrize("model,variant", [(m, v) for m in MODELS for v in VARIANTS] + [(m, None) for m in CPU_MODELS])
def test_the_copy_equals_the_reference_byte_for_byte(model, variant):
    """Every layout (vLLM's CPU one with K transposed included), every order of blocks and rows: the pages the
    copy saves and the engine it loads equal the reference conversion's, byte for byte, and rows or blocks
    outside the copy stay as they were."""
    make = (lambda raw=None: cpu_engine(CPU_MODELS[model], raw)) if variant is None else \
        (lambda raw=None: engine(variant, model, raw))
    src = make()
    fill(src, 6)
    fast, ref = formats(src, model)
    assert fast.format_id == ref.format_id
    for k, (ids, rows) in enumerate(ID_ROWS):
        got = torch.full((14, fast.page_bytes), 0xA5, dtype=torch.uint8)
        want = got.clone()
        fast.gather(ids, got, rows)
        ref.gather(ids, want, rows)
        assert torch.equal(got, want), (ids, rows)
        gen = torch.Generator().manual_seed(k)
        pages = torch.randint(0, 256, (14, fast.page_bytes), dtype=torch.uint8, generator=gen)
        a, b = make(), make()
        fill(a, 7)
        b.raw.copy_(a.raw)
        formats(a, model)[0].scatter(pages, ids, rows)
        formats(b, model)[1].scatter(pages, ids, rows)
        assert torch.equal(a.raw, b.raw), (ids, rows)


def test_runs_cover_every_pair_once_stepping_forward():
    from kvservice.integrations.vllm.connector.pagecopy import runs
    for ids, rows in ID_ROWS + [([], []), ([5], [0])]:
        got = runs(ids, rows)
        pairs = [(b + i * db, r + i * dr) for b, db, r, dr, k in got for i in range(k)]
        assert sorted(pairs) == sorted(zip(ids, rows)) and all(db > 0 and dr > 0 for _, db, _, dr, _ in got)
    assert runs([9, 8, 7, 6], [13, 12, 11, 10]) == [(6, 1, 10, 1, 4)]
    assert len(runs([0, 1, 2, 3, 4], [10, 9, 8, 7, 6])) == 5


def test_head_major_pages_are_the_blocks_own_bytes():
    e = engine(("LBHNC", 1), "mha-bf16")
    fill(e, 2)
    pages = gather(e.format(), [3, 8])
    page = e.raw.numel() // LAYERS // BLOCKS
    for row, b in enumerate([3, 8]):
        own = torch.cat([e.raw.view(torch.uint8)[(layer * BLOCKS + b) * page:][:page] for layer in range(LAYERS)])
        assert torch.equal(pages[row], own)


@pytest.mark.parametrize("fast", [True, False])
def test_a_pool_past_2_gib_is_written_in_place(fast):
    # untouched torch.empty pages are never resident: only the blocks copied below are
    heads, tokens, content, num_blocks = 8, 16, 256, 20_000
    raw = torch.empty(2 * num_blocks * heads * tokens * content * 2, dtype=torch.int8)
    e = by_hand("LBNHC", 2, num_blocks, heads, tokens, content, torch.bfloat16, raw=raw)
    fmt = e.format(fast=fast)
    last = e.caches["model.layers.1.self_attn.attn"][num_blocks - 1]
    last.view(torch.int8).copy_(torch.randint(-128, 128, last.view(torch.int8).shape, dtype=torch.int8))
    e.caches["model.layers.0.self_attn.attn"][num_blocks - 1].zero_()
    pages = gather(fmt, [num_blocks - 1])
    assert torch.equal(pages[0], reference_page(e, num_blocks - 1))
    neighbour = e.caches["model.layers.1.self_attn.attn"][num_blocks - 3].clone()
    fmt.scatter(pages, [num_blocks - 2])
    assert torch.equal(e.caches["model.layers.1.self_attn.attn"][num_blocks - 2].view(torch.int8),
                       last.view(torch.int8))
    assert torch.equal(e.caches["model.layers.1.self_attn.attn"][num_blocks - 3].view(torch.int8),
                       neighbour.view(torch.int8))


def test_shared_kv_layers_are_stored_once_and_loaded_into_both():
    src = engine(("LBNHC", 1), "mha-bf16")
    fill(src, 3)
    caches = dict(src.caches)
    caches["model.layers.99.shared"] = caches["model.layers.4.self_attn.attn"]
    fmt = PageFormat.build(caches, num_blocks=BLOCKS, block_size=BLOCK_SIZE)
    assert fmt.page_bytes == src.format().page_bytes
    assert fmt.aliases == {"model.layers.99.shared": "model.layers.4.self_attn.attn"}
    assert "model.layers.99.shared" not in fmt.layer_names


def test_cpu_attention_pages_are_canonical():
    heads, tokens, d = 2, 32, 16
    cpu = by_hand("LBHNC", 2, 4, heads, tokens, 2 * d, torch.float32)
    k = torch.randn(2, 4, tokens, heads, d)  # layer, block, token, head, dim
    v = torch.randn(2, 4, tokens, heads, d)
    for layer, t in enumerate(cpu.caches.values()):
        for b in range(4):
            for h in range(heads):
                region = t[b, h].view(-1)  # a (block, head) is one dense run: K region, then V region
                region[:tokens * d].copy_(k[layer, b, :, h, :].t().reshape(-1))  # K[t, j] at j*N + t
                region[tokens * d:].copy_(v[layer, b, :, h, :].reshape(-1))
    fmt = cpu.format(cpu_isa="vec", head_size=d)
    gpu = by_hand("LBNHC", 2, 4, heads, tokens, 2 * d, torch.float32)
    assert fmt.format_id == gpu.format().format_id
    pages = gather(fmt, [3, 1])
    gpu.format().scatter(pages, [0, 2])
    for layer, t in enumerate(gpu.caches.values()):
        for dst, src in ((0, 3), (2, 1)):
            assert torch.equal(t[dst, :, :, :d], k[layer, src].transpose(0, 1))
            assert torch.equal(t[dst, :, :, d:], v[layer, src].transpose(0, 1))
    back = by_hand("LBHNC", 2, 4, heads, tokens, 2 * d, torch.float32)
    back.format(cpu_isa="vec16", head_size=d).scatter(pages, [3, 1])
    for name in cpu.caches:
        assert torch.equal(back.caches[name][[3, 1]], cpu.caches[name][[3, 1]])


def test_format_ids():
    def fid(layout="LBNHC", heads=4, content=64, dtype=torch.bfloat16, ratio=1, block_size=16, **kw):
        if "told" in kw:  # the layout string the engine reports, if not the one it has
            kw["layout"] = kw.pop("told")
        return by_hand(layout, 2, 8, heads, block_size, content, dtype, ratio).format(**kw).format_id

    base = fid()
    assert base == "canonical1;bfloat16;layers=2;H=4;N=16;C=64"
    assert base == fid("LBHNC") == fid("BLHNC") == fid("BLNHC") == fid(ratio=2) == fid("LBHNC", ratio=2)
    assert base == fid(told=None) == fid("LBHNC", told="HND") == fid(told="NHD")
    others = [fid(dtype=torch.uint8), fid(heads=1, content=576), fid(heads=2), fid(content=128),
              fid(block_size=32), fid(cache_dtype="fp8_e5m2"), fid(cache_dtype="int8_per_token_head")]
    assert len({base, *others}) == len(others) + 1
    assert fid(cache_dtype="auto") == base
    # opaque pages name the layout (and the CPU ISA): only identical engines share them
    opaque = fid(cache_dtype="nvfp4")
    assert opaque.startswith("opaque1;layout=LBNHC;order=NHC")
    assert opaque != fid("LBHNC", cache_dtype="nvfp4") != fid("LBHNC", ratio=2, cache_dtype="nvfp4")
    amx = by_hand("LBHNC", 2, 8, 2, 32, 64, torch.bfloat16).format(cpu_isa="amx", head_size=32).format_id
    assert "isa=amx" in amx and amx.startswith("opaque1")


def test_opaque_pages_are_the_blocks_bytes_and_round_trip():
    src = engine(("LBNHC", 2), "mha-fp8")
    fill(src, 4)
    fmt = src.format(cache_dtype="int8_per_token_head")
    assert not fmt.canonical
    page = src.raw.numel() // LAYERS // BLOCKS
    pages = gather(fmt, [5, 2])
    assert torch.equal(pages[0], torch.cat([src.raw.view(torch.uint8)[(i * BLOCKS + 5) * page:][:page]
                                            for i in range(LAYERS)]))
    dst = engine(("LBNHC", 2), "mha-fp8")
    dst.format(cache_dtype="int8_per_token_head").scatter(pages, [9, 1])
    assert torch.equal(gather(dst.format(cache_dtype="int8_per_token_head"), [9, 1]), pages)


def hand_view(layout, num_layers=2, num_blocks=4, heads=2, tokens=16, content=8):
    """Layouts vLLM builds only on ROCm (LHBNC) or never here (BHLNC), by hand."""
    raw = torch.zeros(num_layers * num_blocks * heads * tokens * content, dtype=torch.float32)
    sizes = dict(L=num_layers, B=num_blocks, H=heads, N=tokens, C=content)
    phys = raw.view(*(sizes[d] for d in layout))
    rest = layout.replace("L", "")
    return {f"layer.{i}": phys.select(layout.index("L"), i).permute(*(rest.index(d) for d in "BHNC"))
            for i in range(num_layers)}


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
@pytest.mark.parametrize("given", [True, False])
def test_blocks_not_outermost_are_refused(layout, given):
    with pytest.raises(ValueError, match=r"layer 'layer\.0'.*stride.*blocks (are )?not outermost|outermost"):
        PageFormat.build(hand_view(layout), num_blocks=4, block_size=16, layout=layout if given else None)


def test_refusals_name_the_layer_shape_and_layout():
    e = engine(("LBNHC", 2), "mha-bf16")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.attn' \(KV shape \(24, 4, 8, 64\).*"
                                         r"layout LBNHC\): dim 0 must be the 5 scheduler blocks"):
        PageFormat.build(e.caches, num_blocks=5, block_size=16, layout="LBNHC")
    with pytest.raises(ValueError, match="ratio \\* 8 tokens = the block size 8"):
        PageFormat.build(e.caches, num_blocks=BLOCKS, block_size=8, layout="LBNHC")
    with pytest.raises(ValueError, match="layout LBHNC\\): the strides put tokens outside heads \\(NHC\\)"):
        PageFormat.build(e.caches, num_blocks=BLOCKS, block_size=16, layout="LBHNC")
    with pytest.raises(ValueError, match="unknown KV cache layout"):
        PageFormat.build(e.caches, num_blocks=BLOCKS, block_size=16, layout="XYZ")
    mixed = dict(e.caches)
    mixed["model.layers.50.x"] = engine(("LBNHC", 2), "mha-fp8").caches["model.layers.0.self_attn.attn"]
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.50\.x'.*differs from layer "
                                         r"'model\.layers\.0\.self_attn\.attn'"):
        PageFormat.build(mixed, num_blocks=BLOCKS, block_size=16)
    blk = engine(("BLNHC", 1), "mha-bf16")
    t = blk.caches["model.layers.3.self_attn.attn"]
    split = t.as_strided((BLOCKS * 2, 4, 8, 64), (t.stride(0) // 2, 64, 256, 1))  # what vLLM refuses to build
    with pytest.raises(ValueError, match="kernel blocks \\(2 per scheduler block\\) are not dense pages"):
        PageFormat.build({"a": split}, num_blocks=BLOCKS, block_size=16)
    with pytest.raises(ValueError, match="CPU attention \\(vec\\) keeps LBHNC"):
        e.format(cpu_isa="vec", head_size=32)
    cpu = engine(("LBHNC", 1), "mha-bf16")
    with pytest.raises(ValueError, match="head_size=None"):
        cpu.format(cpu_isa="vec")


def test_bad_block_ids_and_pages_are_refused_before_any_copy():
    e = engine(("LBNHC", 1), "mha-bf16")
    fmt = e.format()
    with pytest.raises(ValueError, match="block id 12 is outside the engine's 12 blocks"):
        gather(fmt, [0, 12])
    with pytest.raises(ValueError, match="block id -1"):
        gather(fmt, [-1])
    with pytest.raises(ValueError, match="repeated"):
        fmt.scatter(torch.zeros(2, fmt.page_bytes, dtype=torch.uint8), [3, 3])
    with pytest.raises(ValueError, match=f"pages must be \\[2, {fmt.page_bytes}\\] uint8"):
        fmt.scatter(torch.zeros(2, fmt.page_bytes + 1, dtype=torch.uint8), [3, 4])


def test_misaligned_pages_fall_back_to_narrower_words():
    e = engine(("LBNHC", 1), "mha-bf16")
    fill(e, 5)
    fmt = e.format()
    buf = torch.zeros(2 * fmt.page_bytes + 1, dtype=torch.uint8)
    out = buf[1:].view(2, fmt.page_bytes)
    fmt.gather([4, 6], out)
    assert torch.equal(out, gather(fmt, [4, 6]))
    assert torch.equal(out[1], reference_page(e, 6))
