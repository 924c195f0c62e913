"""The NIXL data plane of the store tier: an engine on another node READs a store's pages straight out of the
store's segment (one-sided: no store code runs per read), instead of through the store's Ray actor and Ray's
object store.

- `NixlExport` (the store process): one NIXL agent, the segment's header page, metadata and pages registered
  once; `info()` is what a reader needs, handed out by the allocator.
- `NixlImport` (`nixl_read.py`, the engine process): one agent, staging buffers registered once;
  `read(info, page_ids, into, meta_into)` is one NIXL READ (one descriptor list) behind a `Ticket`.
- `plan.py`: the descriptor arithmetic.

Every READ also fetches the segment's header and a 32-byte token of the store's agent (the fence), checked before
a ticket says DONE: a reader still holding the info of an agent that was closed or re-created, of a segment
that was replaced or closed, gets ERR. This matters on one host: UCX's `cma` transport (process_vm_readv) reads
the store's address space by pid and, seen with NIXL 1.5.1, can complete a READ against an agent that no longer
exists. The fence is not a lock: the per-page tags and checksums in `meta` stay the check of each page.

Security: UCX has no authentication. Whoever holds a store's `info()` (the agent metadata and the regions'
addresses and keys) can READ the whole segment, and nothing on the store side sees or refuses it. One store is
one tenant's region, so the allocator hands a store's info only to engines of that store's tenant; treat the
info as a credential (not logged, not sent to other tenants).

Operator knobs (environment of both the store and the engine processes, read when the agent is created):
- `UCX_TLS`: unset lets UCX choose (one host: `cma`/shared memory; between hosts: RDMA verbs when the
  devices are in the container, else `tcp`, where UCX emulates the READ and the store's progress thread serves
  it). `UCX_TLS=tcp` forces the TCP path; `UCX_TLS=rc,cma,self` (say) restricts it to RDMA and same-host.
- `UCX_NET_DEVICES`: which NICs/HCAs, e.g. `mlx5_0:1` (RDMA) or `eth0` (tcp); default all.
- `ulimit -l` (RLIMIT_MEMLOCK): RDMA registration pins the registered memory, so a store registering a
  segment of N GiB needs a memlock limit above N GiB (`ulimit -l unlimited`; `--ulimit memlock=-1` in docker;
  `LimitMEMLOCK=infinity` in systemd) or CAP_IPC_LOCK. `cma` and `tcp` pin nothing: a 256 MiB segment
  registers under an 8 MiB limit without CAP_IPC_LOCK (measured). A registration UCX refuses raises
  `NixlRegistrationError` saying which limit to raise.
- The store's agent runs a progress thread (NIXL's `enable_prog_thread`): without it UCX's emulated READ
  (tcp) never completes. Readers progress their own agent while they poll a ticket.
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import resource
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields, replace
from types import ModuleType

import numpy as np

from kvservice.blockstore.segment import _HEADER, HEADER_BYTES, MAX_SLOTS, META_FIELDS, Segment

# The NIXL meta package `nixl` picks the wheel of the CUDA the process has; `nixl-cu12` alone (what
# `pip install 'kvservice[nixl]'` brings, and all a CPU host needs) is importable as `nixl_cu12`.
_API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")

TOKEN_MAGIC = int.from_bytes(b"KVSNIXL1", "little")
TOKEN_WORDS = 4  # magic, agent id (2 words), zero
META_ROW_BYTES = MAX_SLOTS * META_FIELDS * 8
FENCE_HEADER_BYTES = _HEADER.itemsize  # the fields of the header page a reader checks


class NixlUnavailable(RuntimeError):
    """NIXL cannot be imported here, or cannot make an agent with the UCX backend."""


class NixlRegistrationError(RuntimeError):
    """UCX refused to register a store's segment (typically: RDMA pinning over the memlock limit)."""


_api: ModuleType | None = None
_unavailable: str | None = None


def load_api() -> ModuleType:
    """NIXL's Python API module (`nixl._api` or the backend wheel's), imported once. Raises NixlUnavailable."""
    global _api
    if _api is None:
        tried = []
        for name in _API_MODULES:
            try:
                _api = importlib.import_module(name)
                if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent's creation at INFO, on stdout
                    logging.getLogger("nixl").setLevel(logging.WARNING)
                break
            except ImportError as e:
                tried.append(f"{name}: {e}")
        else:
            raise NixlUnavailable("NIXL is not importable (" + "; ".join(tried) + "): pip install 'kvservice[nixl]'")
    return _api


def nixl_errors() -> tuple[type[BaseException], ...]:
    """The exception types NIXL's bindings raise (they share no base class)."""
    bindings = load_api().nixlBind
    return tuple(getattr(bindings, n) for n in dir(bindings) if n.startswith("nixl") and n.endswith("Error"))


# NIXL's Python wrapper runs the progress thread with no pause between polls (pthrDelay = 0): an idle store
# burned a whole core. It sleeps this long between polls instead (KVSERVICE_NIXL_PROGRESS_DELAY_US; 0: spin).
PROGRESS_DELAY_US = int(os.environ.get("KVSERVICE_NIXL_PROGRESS_DELAY_US", "100"))
_CONFIG_LOCK = threading.Lock()


def _paced_config(base: type, delay_us: int) -> type:
    """nixlAgentConfig whose progress-thread delay is at least `delay_us` (the wrapper sets it to 0)."""

    class PacedConfig(base):
        @property
        def pthrDelay(self):  # noqa: N802 - the binding's name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), delay_us))

    return PacedConfig


def make_agent(name: str, progress_thread: bool, backends: tuple[str, ...] = ("UCX",)):
    """A NIXL agent with UCX and no listen thread (metadata travels through the allocator, not NIXL's socket);
    its progress thread (if any) paced by PROGRESS_DELAY_US."""
    api = load_api()
    try:
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False,
                                       backends=list(backends))
        with _CONFIG_LOCK:  # the wrapper builds its config from the bindings' class: paced for this call only
            bindings = api.nixlBind
            base = bindings.nixlAgentConfig
            bindings.nixlAgentConfig = _paced_config(base, PROGRESS_DELAY_US) if PROGRESS_DELAY_US else base
            try:
                agent = api.nixl_agent(name, config)
            finally:
                bindings.nixlAgentConfig = base
    except nixl_errors() as e:
        raise NixlUnavailable(
            f"NIXL agent {name}: backend(s) {list(backends)} failed to start ({type(e).__name__}: {e}); with "
            f"UCX_TLS={os.environ.get('UCX_TLS', '(unset)')} UCX may have found no usable transport or device: "
            "see UCX's own log lines (UCX_LOG_LEVEL=info for more)") from e
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise NixlUnavailable(f"NIXL agent {name}: backend(s) {missing} not available (plugins here: "
                              f"{agent.get_plugin_list()})")
    return agent


def nixl_available() -> bool:
    """Whether NIXL imports and makes an agent with the UCX backend here (asked once per process)."""
    global _unavailable
    if _unavailable is None:
        try:
            make_agent(f"kvservice-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}", progress_thread=False)
            _unavailable = ""
        except Exception as e:  # any failure here means "not available": keep the reason
            _unavailable = f"{type(e).__name__}: {e}"
    return not _unavailable


def nixl_unavailable_reason() -> str:
    """One line: why `nixl_available()` is False ("" when it is True)."""
    nixl_available()
    return _unavailable.splitlines()[0] if _unavailable else ""


@dataclass(frozen=True, slots=True)
class ExportInfo:
    """What an engine needs to READ a store's segment; `to_dict()` is JSON. A credential (see the module doc)."""

    store: str
    tenant: str
    agent_name: str
    agent_id: str  # new for every agent
    generation: int  # when the agent was made (ns; grows): a reader refuses an older one than it has seen
    agent_metadata: str  # base64 of the agent's NIXL metadata (its UCX worker address)
    header_addr: int
    meta_addr: int
    meta_bytes: int
    pages_addr: int
    pages_bytes: int
    token_addr: int
    page_bytes: int
    num_blocks: int
    slots: int
    segment_generation: int  # the store's pool epoch when info() was asked: a READ once it moved on gets ERR

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ExportInfo:
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"store export info: missing {missing} (got keys {sorted(d)}): not a NixlExport.info()")
        info = cls(**{n: d[n] for n in names})
        if info.slots != MAX_SLOTS:
            raise ValueError(f"store {info.store}: its pages have {info.slots} metadata slots, this engine's code "
                             f"{MAX_SLOTS}: run the same kvservice version on both")
        return info

    def token(self) -> np.ndarray:
        """The fence words the store's token region holds while this agent lives."""
        ident = uuid.UUID(hex=self.agent_id).int
        return np.array([TOKEN_MAGIC, ident >> 64, ident & (2**64 - 1), 0], dtype=np.uint64)


_last_generation = 0


def _next_generation() -> int:
    global _last_generation
    _last_generation = max(time.time_ns(), _last_generation + 1)
    return _last_generation


class NixlExport:
    """A store's segment exported through one NIXL agent (one per store process; make it once, close it before
    the segment). A new export of the same segment has a new `agent_id`: readers of the old one get ERR."""

    def __init__(self, segment: Segment, store_name: str, tenant: str, *,
                 backends: tuple[str, ...] = ("UCX",)) -> None:
        self.segment, self.store_name, self.tenant = segment, store_name, tenant
        self.agent_id = uuid.uuid4().hex
        self.agent_name = f"kvs-store-{store_name}-{self.agent_id[:12]}"
        self._token = np.zeros(TOKEN_WORDS, dtype=np.uint64)
        self._agent = make_agent(self.agent_name, progress_thread=True, backends=backends)
        regions = [(segment.header.ctypes.data, HEADER_BYTES, 0, ""),
                   (segment.meta.ctypes.data, segment.meta.nbytes, 0, ""),
                   (segment.pages.ctypes.data, segment.pages.nbytes, 0, ""),
                   (self._token.ctypes.data, self._token.nbytes, 0, "")]
        try:
            self._registered = self._agent.register_memory(regions, "DRAM")
        except nixl_errors() as e:
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
            raise NixlRegistrationError(
                f"store {store_name}: UCX could not register segment {segment.path} ({segment.pages.nbytes} bytes "
                f"of pages): {type(e).__name__}: {e}. RDMA transports pin registered memory: raise the store "
                f"process's memlock limit (now {limit}) above the segment (`ulimit -l unlimited`, docker "
                f"`--ulimit memlock=-1`), or give it CAP_IPC_LOCK, or set UCX_TLS=tcp to serve without RDMA") from e
        self._info = ExportInfo(
            store=store_name, tenant=tenant, agent_name=self.agent_name, agent_id=self.agent_id,
            generation=_next_generation(), agent_metadata=base64.b64encode(self._agent.get_agent_metadata()).decode(),
            header_addr=segment.header.ctypes.data, meta_addr=segment.meta.ctypes.data,
            meta_bytes=segment.meta.nbytes, pages_addr=segment.pages.ctypes.data,
            pages_bytes=segment.pages.nbytes, token_addr=self._token.ctypes.data, page_bytes=segment.page_bytes,
            num_blocks=segment.num_blocks, slots=MAX_SLOTS, segment_generation=segment.generation)
        self._token[:] = self._info.token()  # last: a reader's fence passes only once all is registered

    def info(self) -> dict:
        """What the allocator hands to this tenant's engines (JSON-serialisable)."""
        if self._agent is None:
            raise RuntimeError(f"store {self.store_name}: its NIXL export {self.agent_id} is closed")
        return replace(self._info, segment_generation=self.segment.generation).to_dict()

    def close(self) -> None:
        """Stop serving: readers' fences fail from now on; then the memory is deregistered and the agent goes."""
        if self._agent is None:
            return
        self._token[:] = 0
        self._agent.deregister_memory(self._registered)
        self._agent = self._registered = None  # the agent (its UCX worker, progress thread) goes with it

    def __enter__(self) -> NixlExport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
