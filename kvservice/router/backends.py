"""The fleet's engines as the router knows them: one `Backend` per vLLM server, from `--backend` flags or a
backends file (YAML or JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

ROLES = {"both": "both", "kv_both": "both", "prefill": "prefill", "kv_producer": "prefill", "decode": "decode",
         "kv_consumer": "decode"}
STORE_RAM, STORE_DISK = "kvstore:", "kvdisk:"


@dataclass(slots=True, frozen=True)
class Backend:
    """A vLLM OpenAI server. `pool`: its external pool (the `--vllm-events` name its KV events feed; default:
    its name). `node`: the name of the store on its node (pools kvstore:NODE and kvdisk:NODE; empty: no
    store). `connector`: it runs kvservice's KV connector, so it loads from stores (default: when it has a
    node). `role`: both, prefill (`kv_producer`) or decode (`kv_consumer`). `events`/`replay`: its KV events
    endpoints, for the router to register its external pool (RegisterExternalPool) itself."""

    name: str
    url: str
    pool: str = ""
    node: str = ""
    role: str = "both"
    connector: bool | None = None
    events: str = ""
    replay: str = ""
    block_size: int = 0  # with events: the engine's --block-size (0: the router's --block-size)
    hash: str = "sha256"  # with events: its --prefix-caching-hash-algo

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in " ,=\n"):
            raise ValueError(f"backend name {self.name!r}: non-empty, without spaces, commas or '='")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend {self.name}: url {self.url!r} is not http:// or https://")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.pool:
            object.__setattr__(self, "pool", self.name)
        if self.role not in ROLES:
            raise ValueError(f"backend {self.name}: role {self.role!r} is none of {', '.join(ROLES)}")
        object.__setattr__(self, "role", ROLES[self.role])
        if self.connector is None:
            object.__setattr__(self, "connector", bool(self.node))
        if self.replay and not self.events:
            raise ValueError(f"backend {self.name}: replay={self.replay!r} needs events=")

    @property
    def store_pools(self) -> tuple[str, str]:
        return (STORE_RAM + self.node, STORE_DISK + self.node) if self.node else ("", "")

    @property
    def decodes(self) -> bool:
        return self.role in ("both", "decode")


FIELDS = {f.name for f in fields(Backend)}


def _value(name: str, key: str, text: str):
    if key == "connector":
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"backend {name}: connector={text!r} is not true or false")
        return text.lower() in ("true", "1", "yes")
    if key == "block_size":
        if not text.isdigit():
            raise ValueError(f"backend {name}: block_size={text!r} is not a whole number")
        return int(text)
    return text


def parse_backend(text: str) -> Backend:
    """`NAME=URL[,pool=ID][,node=STORE][,role=ROLE][,connector=BOOL][,events=EP][,replay=EP][,block_size=N]`."""
    head, *rest = text.split(",")
    name, sep, url = head.partition("=")
    if not sep:
        raise ValueError(f"--backend wants NAME=URL[,pool=ID,...], got {text!r}")
    kw = {}
    for part in rest:
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in FIELDS - {"name", "url"}:
            raise ValueError(f"--backend {name}: {part!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(sorted(FIELDS - {'name', 'url'}))}")
        kw[key] = _value(name, key, value.strip())
    return Backend(name.strip(), url.strip(), **kw)


def backends_from_data(data) -> list[Backend]:
    """A backends file's content: a list of backends, or {"backends": [...]}; each a mapping of Backend's
    fields (`name`, `url` required)."""
    if isinstance(data, dict):
        data = data.get("backends")
    if not isinstance(data, list):
        raise ValueError("a backends file holds a list of backends, or a mapping with a list under 'backends'")
    out: list[Backend] = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise ValueError(f"backends[{i}] is {type(entry).__name__}, not a mapping of name, url, pool, ...")
        unknown = set(entry) - FIELDS
        if unknown:
            raise ValueError(f"backends[{i}]: unknown key(s) {', '.join(sorted(unknown))} (known: "
                             f"{', '.join(sorted(FIELDS))})")
        if "name" not in entry or "url" not in entry:
            raise ValueError(f"backends[{i}] needs a name and a url")
        out.append(Backend(**{k: (str(v) if k not in ("connector", "block_size") else v) for k, v in entry.items()}))
    names = [b.name for b in out]
    if len(names) != len(set(names)):
        raise ValueError(f"backend names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return out


def load_mapping_file(path: str | Path):
    """YAML or JSON (JSON first: it is YAML too, but faster and stricter)."""
    text = Path(path).read_text()
    try:
        return json.loads(text)
    except ValueError:
        import yaml
        return yaml.safe_load(text)


def read_backends_file(path: str | Path) -> list[Backend]:
    return backends_from_data(load_mapping_file(path))
