"""Engine KV views in every vLLM layout (by hand, or by vLLM's own `create_kv_cache_views`), a naive per-block
reference of the canonical page, and a round-trip check through `PageFormat` (tests/test_page_format.py,
tests/vllm/test_connector_layouts.py, tests/vllm_engine/test_page_layouts.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvservice.integrations.vllm.connector.pageformat import PageFormat, layer_order

LAYOUTS = ("LBNHC", "LBHNC", "BLHNC", "BLNHC")


@dataclass(slots=True)
class Engine:
    """One engine's KV: the shared int8 pool and its per-layer logical [B, H, N, C] views (kernel blocks)."""

    raw: torch.Tensor
    caches: dict[str, torch.Tensor]
    layout: str
    num_blocks: int
    block_size: int

    def format(self, **kwargs) -> PageFormat:
        return PageFormat.build(self.caches, num_blocks=self.num_blocks, block_size=self.block_size,
                                layout=kwargs.pop("layout", self.layout), **kwargs)


def layer_names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def by_hand(layout: str, num_layers: int, num_blocks: int, heads: int, block_size: int, content: int,
            dtype: torch.dtype, ratio: int = 1, raw: torch.Tensor | None = None) -> Engine:
    """The views vLLM builds, by hand: one int8 pool, physical order `layout`, logical [B*ratio, H, N/ratio, C]."""
    nb, tokens = num_blocks * ratio, block_size // ratio
    es = torch.empty(0, dtype=dtype).element_size()
    if raw is None:
        raw = torch.zeros(num_layers * nb * heads * tokens * content * es, dtype=torch.int8)
    sizes = dict(L=num_layers, B=nb, H=heads, N=tokens, C=content)
    phys = raw.view(dtype).view(*(sizes[d] for d in layout))  # a layout names its physical dim order
    views = {}
    for i, name in enumerate(layer_names(num_layers)):
        layer = phys.select(layout.index("L"), i)
        rest = layout.replace("L", "")
        views[name] = layer.permute(*(rest.index(d) for d in "BHNC"))
    return Engine(raw, views, layout, num_blocks, block_size)


def by_vllm(layout: str, num_layers: int, num_blocks: int, heads: int, block_size: int, head_size: int,
            dtype: torch.dtype, ratio: int = 1, mla: bool = False, raw: torch.Tensor | None = None) -> Engine:
    """The same views from vLLM's own planner strides and `create_kv_cache_views` (0.32 and 0.33 share them)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec_cls = MLAAttentionSpec if mla else FullAttentionSpec
    spec = spec_cls(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    order, page, names = KVCacheLayout[layout], spec.page_size_bytes, layer_names(num_layers)
    # as get_kv_cache_config_from_groups places one group's layers
    fixed = page * num_layers if order.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers, order,
                                                            fixed_strides=(None, fixed, None, None, None))
    tensor = KVCacheTensor(size=page * num_blocks * num_layers, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    if raw is None:
        raw = torch.zeros(tensor.size, dtype=torch.int8)
    kernel = block_size // ratio if ratio > 1 else None
    views = create_kv_cache_views(raw, spec, num_blocks, order, tensor, kernel)
    return Engine(raw, dict(zip(names, views)), layout, num_blocks, block_size)


VLLM_MODELS = {  # heads, head_size, storage dtype, MLA
    "mha-bf16": (4, 32, torch.bfloat16, False),
    "mha-fp8": (4, 32, torch.uint8, False),
    "mla-bf16": (1, 576, torch.bfloat16, True),
    "mla-fp8": (1, 576, torch.uint8, True),
}
# vLLM splits kernel blocks only in layer-outer layouts (block-outer ones raise: vllm_refusals)
VLLM_VARIANTS = [(layout, ratio) for layout in LAYOUTS for ratio in (1, 2) if ratio == 1 or layout.startswith("LB")]


def vllm_engine(model: str, variant: tuple[str, int], raw: torch.Tensor | None = None) -> Engine:
    heads, head_size, dtype, mla = VLLM_MODELS[model]
    return by_vllm(variant[0], 3, 8, heads, 16, head_size, dtype, variant[1], mla, raw=raw)


def vllm_round_trip(model: str, src_variant: tuple[str, int], dst_variant: tuple[str, int]) -> None:
    """Pages saved from vLLM's views of one layout, loaded into another's; the reference groups kernel blocks
    with vLLM's own group_kernel_blocks (and agrees with the by-hand grouping)."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    for seed, (src_ids, dst_ids) in enumerate([([5, 1, 7], [2, 6, 0]), ([2, 3, 4, 5], [4, 5, 6, 7])]):
        src, dst = vllm_engine(model, src_variant), vllm_engine(model, dst_variant)
        fill(src, seed)
        fill(dst, seed + 100)
        for b in src_ids:
            assert torch.equal(reference_page(src, b, group_kernel_blocks), reference_page(src, b))
        check_round_trip(src, dst, vllm_engine(model, dst_variant, raw=dst.raw.clone()), src_ids, dst_ids,
                         grouped=group_kernel_blocks)


def vllm_refusals() -> None:
    """What vLLM will not build (block-outer kernel splits), and the layouts it builds that are refused."""
    import pytest

    with pytest.raises(ValueError, match="cannot be split"):
        vllm_engine("mha-bf16", ("BLHNC", 2))
    for layout in ("LHBNC", "BHLNC"):
        e = vllm_engine("mha-bf16", (layout, 1))
        with pytest.raises(ValueError, match=f"layer 'model.layers.0.self_attn.attn'.*layout {layout}.*outermost"):
            e.format()
    # MLA (H=1): LHBNC is then LBNHC in memory, but the layout names blocks that are not outermost
    with pytest.raises(ValueError, match="layout LHBNC\\): the blocks are not outermost"):
        vllm_engine("mla-bf16", ("LHBNC", 1)).format()


def like(engine: Engine, builder, *args, **kwargs) -> Engine:
    """The same engine again over a copy of its pool (what the engine should hold after a naive write)."""
    return builder(*args, raw=engine.raw.clone(), **kwargs)


def fill(engine: Engine, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    engine.raw.copy_(torch.randint(-128, 128, engine.raw.shape, dtype=torch.int8, generator=gen))


def unique_layers(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    out, seen = [], set()
    for name in sorted(caches, key=layer_order):
        t = caches[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.stride(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def kernel_blocks(t: torch.Tensor, block: int, num_blocks: int) -> torch.Tensor:
    """Scheduler block `block` of a layer as [ratio, H, N/ratio, C] (vLLM's group_kernel_blocks, by hand)."""
    ratio = t.shape[0] // num_blocks
    return t[block * ratio:(block + 1) * ratio]


def reference_page(engine: Engine, block: int, grouped=None) -> torch.Tensor:
    """The canonical page of one block, naively: per layer, logical indexing and a permute to [H, N, C]."""
    parts = []
    for t in unique_layers(engine.caches):
        if grouped is None:
            k = kernel_blocks(t, block, engine.num_blocks)
        else:  # vLLM's group_kernel_blocks leaves an unsplit cache as it is
            k = grouped(t, engine.num_blocks)[block]
            k = k if k.dim() == 4 else k.unsqueeze(0)
        parts.append(k.permute(1, 0, 2, 3).contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts)


def write_reference(engine: Engine, block: int, page: torch.Tensor) -> None:
    """The inverse of reference_page, block by block, through the logical views."""
    offset = 0
    for t in unique_layers(engine.caches):
        k = kernel_blocks(t, block, engine.num_blocks)  # [ratio, H, n, C], a view of the pool
        size = k.numel() * k.element_size()
        logical = page[offset:offset + size].view(t.dtype).view(k.shape[1], k.shape[0], k.shape[2], k.shape[3])
        k.copy_(logical.permute(1, 0, 2, 3))
        offset += size


def gather(fmt: PageFormat, block_ids: list[int]) -> torch.Tensor:
    out = torch.full((len(block_ids), fmt.page_bytes), 0xA5, dtype=torch.uint8)
    fmt.gather(block_ids, out)
    return out


def check_round_trip(src: Engine, dst: Engine, expected: Engine, src_ids: list[int], dst_ids: list[int],
                     grouped=None, **build) -> None:
    """Pages of `src_ids` equal the naive reference; loaded into `dst` at `dst_ids` they change exactly what
    the naive per-block writes change in `expected` (a copy of dst's pool before the load)."""
    src_fmt, dst_fmt = src.format(**build), dst.format(**build)
    assert src_fmt.format_id == dst_fmt.format_id, (src_fmt.format_id, dst_fmt.format_id)
    pages = gather(src_fmt, src_ids)
    for row, b in enumerate(src_ids):
        assert torch.equal(pages[row], reference_page(src, b, grouped)), f"{src.layout} block {b}: page differs"
    dst_fmt.scatter(pages, dst_ids)
    for row, b in enumerate(dst_ids):
        write_reference(expected, b, pages[row])
    assert torch.equal(dst.raw, expected.raw), f"{src.layout} -> {dst.layout}: the engine's pool differs"
    for row, b in enumerate(dst_ids):
        assert torch.equal(reference_page(dst, b), pages[row])
