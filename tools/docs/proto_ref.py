"""The proto reference page, written from allocator.proto's descriptor (protoc with source info), so the
page is the contract itself: every service, method, message, field and enum, with the proto's comments."""

from __future__ import annotations

import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto" / "kvservice" / "v1"
PROTOS = ("allocator.proto",)
# SourceCodeInfo paths: field numbers of FileDescriptorProto / DescriptorProto / ServiceDescriptorProto.
MESSAGE, ENUM, SERVICE = 4, 5, 6
FIELD, NESTED, NESTED_ENUM = 2, 3, 4
METHOD, ENUM_VALUE = 2, 2
TYPE_NAMES = {v: k[len("TYPE_"):].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}


def descriptor_set(proto_dir: Path = PROTO_DIR, protos: tuple[str, ...] = PROTOS) -> descriptor_pb2.FileDescriptorSet:
    import grpc_tools
    from grpc_tools import protoc  # dev extra; the well-known types ship inside it
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        rc = protoc.main(["protoc", f"-I{proto_dir}", f"-I{include}", "--include_source_info",
                          f"--descriptor_set_out={out}", *protos])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) on {proto_dir}/{protos}")
        fds = descriptor_pb2.FileDescriptorSet()
        fds.ParseFromString(out.read_bytes())
    return fds


def anchor(full_name: str) -> str:
    return full_name.strip(".").replace(".", "-").lower()


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def type_ref(name: str, package: str) -> str:
    short = name.strip(".")
    if short.startswith(package + "."):
        return f"[`{short[len(package) + 1:]}`](#{anchor(short)})"
    return f"`{short}`"


def field_type(f, package: str) -> str:
    return type_ref(f.type_name, package) if f.type_name else f"`{TYPE_NAMES[f.type]}`"


class Comments:
    def __init__(self, file: descriptor_pb2.FileDescriptorProto):
        self.by_path = {}
        for loc in file.source_code_info.location:
            text = (loc.leading_comments or loc.trailing_comments).strip()
            if text:
                self.by_path[tuple(loc.path)] = "\n".join(line.strip() for line in text.splitlines())

    def get(self, path: tuple[int, ...]) -> str:
        return self.by_path.get(path, "")


def render_message(msg, path, prefix, package, comments, out: list[str]) -> None:
    full = f"{prefix}.{msg.name}"
    short = full[len(package) + 1:]
    out += [f"### {short} {{ #{anchor(full)} }}", ""]
    if text := comments.get(path):
        out += [text, ""]
    maps = {f"{full}.{n.name}": n for n in msg.nested_type if n.options.map_entry}
    if msg.field:
        out += ["| field | # | type | comment |", "|---|---:|---|---|"]
        for i, f in enumerate(msg.field):
            kind = field_type(f, package)
            if entry := maps.get(f.type_name.strip(".")):
                kind = f"map<{field_type(entry.field[0], package)}, {field_type(entry.field[1], package)}>"
            elif f.label == f.LABEL_REPEATED:
                kind = f"repeated {kind}"
            elif f.proto3_optional:
                kind = f"optional {kind}"
            out.append(f"| `{f.name}` | {f.number} | {kind} | {cell(comments.get(path + (FIELD, i)))} |")
        out.append("")
    else:
        out += ["No fields.", ""]
    for i, e in enumerate(msg.enum_type):
        render_enum(e, path + (NESTED_ENUM, i), full, package, comments, out)
    for i, nested in enumerate(msg.nested_type):
        if not nested.options.map_entry:
            render_message(nested, path + (NESTED, i), full, package, comments, out)


def render_enum(enum, path, prefix, package, comments, out: list[str]) -> None:
    full = f"{prefix}.{enum.name}"
    out += [f"### {full[len(package) + 1:]} {{ #{anchor(full)} }}", ""]
    if text := comments.get(path):
        out += [text, ""]
    out += ["| value | # | comment |", "|---|---:|---|"]
    for i, v in enumerate(enum.value):
        out.append(f"| `{v.name}` | {v.number} | {cell(comments.get(path + (ENUM_VALUE, i)))} |")
    out.append("")


def render_file(file: descriptor_pb2.FileDescriptorProto) -> list[str]:
    comments, package = Comments(file), file.package
    out = [f"## `{file.name}` (package `{package}`)", ""]
    for si, svc in enumerate(file.service):
        out += [f"### service {svc.name} {{ #{anchor(package + '.' + svc.name)} }}", ""]
        if text := comments.get((SERVICE, si)):
            out += [text, ""]
        out += ["| method | request | response | comment |", "|---|---|---|---|"]
        for mi, m in enumerate(svc.method):
            req = ("stream " if m.client_streaming else "") + type_ref(m.input_type, package)
            rep = ("stream " if m.server_streaming else "") + type_ref(m.output_type, package)
            out.append(f"| `{m.name}` | {req} | {rep} | {cell(comments.get((SERVICE, si, METHOD, mi)))} |")
        out.append("")
    for i, e in enumerate(file.enum_type):
        render_enum(e, (ENUM, i), package, package, comments, out)
    for i, msg in enumerate(file.message_type):
        render_message(msg, (MESSAGE, i), package, package, comments, out)
    return out


def page() -> str:
    head = ["# gRPC API (`proto/kvservice/v1`)", "",
            "Generated at build time from the `.proto` source by `tools/docs/proto_ref.py` (protoc's descriptor "
            "with its comments): this page cannot drift from the contract.", ""]
    files = [f for f in descriptor_set().file if f.name in PROTOS]
    if text := Comments(files[0]).get((12,)) if files else "":  # the syntax line's leading comment: the header
        head += [text, ""]
    body = [line for f in files for line in render_file(f)]
    return "\n".join(head + body) + "\n"


if __name__ == "__main__":
    print(page())
