"""Protobuf <-> domain translation: the hot paths equal their plain definitions.

`serialize_step` must give `SerializeToString()`'s bytes; `decode_add` (which formats field paths only for
an error) must accept, reject and name exactly what the field rules applied one by one do; `decode_batch`'s
whole-list id check names the first bad id as `check_id` would.
"""

from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvservice._proto import allocator_pb2 as pb
from kvservice.errors import InvalidArgument
from kvservice.hashing import MultiModalItem
from kvservice.ops import AddRequestOp, AdmitBatchOp, AllocateOp, DecodeBatchOp, ForkOp, FreeOp
from kvservice.wire.decode import decode_add, decode_admit, decode_batch
from kvservice.wire.encode import encode_op
from kvservice.wire.fields import check_id, check_name, decode_hashes, decode_u32
from kvservice.wire.framing import serialize_step

MAX_LEN, VOCAB, HASH_BS = 64, 1000, 16


def outcome(fn, *args):
    try:
        return fn(*args)
    except InvalidArgument as exc:
        return ("InvalidArgument", str(exc))


@given(st.lists(st.sampled_from(["add", "allocate", "decode", "free", "fork"]), max_size=40),
       st.integers(1, 9000), st.text(max_size=5), st.integers(0, 2**64 - 1))
def test_serialize_step_equals_serialize_to_string(kinds, prompt_len, pool_id, sequence):
    msg = pb.StepRequest(session_id="s" * 32, sequence=sequence, pool_id=pool_id)
    for i, kind in enumerate(kinds):
        op = {"add": AddRequestOp(f"r{i}", token_ids=list(range(prompt_len))),
              "allocate": AllocateOp(f"r{i}", num_computed_tokens=i, num_new_tokens=prompt_len),
              "decode": DecodeBatchOp([f"r{j}" for j in range(i)], list(range(i)), list(range(i))),
              "free": FreeOp(f"r{i}"), "fork": ForkOp(f"r{i}", f"c{i}")}[kind]
        encode_op(op, msg.ops.add())
    assert serialize_step(msg) == msg.SerializeToString()


def test_serialize_step_of_a_large_admission():
    msg = pb.StepRequest(session_id="s", sequence=300, pool_id="p")
    for i in range(32):  # 32 x 1,024 tokens: past the 128 KiB where upb's own serializer slows down
        encode_op(AddRequestOp(f"a{i}", token_ids=list(range(i, i + 1024))), msg.ops.add())
        encode_op(AllocateOp(f"a{i}", num_new_tokens=1024), msg.ops.add())
    data = serialize_step(msg)
    assert len(data) > 128 * 1024 and data == msg.SerializeToString()
    assert pb.StepRequest.FromString(data) == msg


EDGE_IDS = ["", "r", "x" * 64, "x" * 65, "x" * 257, "a\x00b", "a\x1fb", "\n", "é" * 64, "é" * 100, "é" * 129,
            "🙂" * 64, "🙂" * 65]
EDGE_NAMES = ["", "s", "é" * 64, "é" * 65, "é" * 129, "x" * 257, "🙂" * 64, "🙂" * 65]
IDS = st.one_of(st.sampled_from(EDGE_IDS), st.text(max_size=8))
NAMES = st.one_of(st.sampled_from(EDGE_NAMES), st.text(max_size=4))
TOKENS = st.one_of(st.lists(st.integers(0, 1200), min_size=1, max_size=70).map(lambda t: array("I", t).tobytes()),
                   st.sampled_from([b"", b"\x01", b"\x01\x00\x00\x00\x02"]))


def reference_add(a: pb.AddRequestOp, vocab: int, f: str = "ops[3].add") -> AddRequestOp:
    """The add op's rules, one check after another, each field's path formatted up front."""
    request_id = check_id(f"{f}.request_id", a.request_id)
    mm = tuple(MultiModalItem(check_id(f"{f}.mm_items[{j}].identifier", m.identifier), m.offset, m.length)
               for j, m in enumerate(a.mm_items))
    if a.block_hashes or (a.num_tokens and not a.token_ids):  # by hashes (none under one block)
        if a.token_ids:
            raise InvalidArgument(f"{f}.token_ids", f"<{len(a.token_ids)} bytes>", "send token_ids or block_hashes, "
                                                                                   "not both")
        if a.cache_salt or mm:
            raise InvalidArgument(f"{f}.cache_salt" if a.cache_salt else f"{f}.mm_items", "...",
                                  "with block_hashes the client hashes salt and multimodal items itself")
        hashes = decode_hashes(f"{f}.block_hashes", a.block_hashes)
        if a.num_tokens == 0 or a.num_tokens > MAX_LEN:
            raise InvalidArgument(f"{f}.num_tokens", a.num_tokens, f"must be in [1, max_model_len {MAX_LEN}]")
        if len(hashes) != a.num_tokens // HASH_BS:
            raise InvalidArgument(f"{f}.block_hashes", f"<{len(hashes)} hashes>", f"{a.num_tokens} tokens need "
                                  f"{a.num_tokens // HASH_BS} hashes at hash block size {HASH_BS}")
        return AddRequestOp(request_id, None, hashes, a.num_tokens, None, check_name(f"{f}.lora_name", a.lora_name))
    tokens = decode_u32(f"{f}.token_ids", a.token_ids, vocab)
    if not tokens:
        raise InvalidArgument(f"{f}.token_ids", "<0 bytes>", "a request needs at least one token (or block_hashes "
                                                             "with num_tokens)")
    if len(tokens) > MAX_LEN:
        raise InvalidArgument(f"{f}.token_ids", f"<{len(tokens)} tokens>", f"exceeds max_model_len {MAX_LEN}")
    if a.num_tokens and a.num_tokens != len(tokens):
        raise InvalidArgument(f"{f}.num_tokens", a.num_tokens, f"disagrees with the {len(tokens)} token ids")
    for j, m in enumerate(mm):
        if m.length == 0 or m.offset + m.length > len(tokens):
            raise InvalidArgument(f"{f}.mm_items[{j}]", (m.offset, m.length), "must lie inside the prompt")
    return AddRequestOp(request_id, tokens, None, len(tokens), check_name(f"{f}.cache_salt", a.cache_salt),
                        check_name(f"{f}.lora_name", a.lora_name), mm)


def check_add(a: pb.AddRequestOp, vocab: int) -> None:
    fast = outcome(decode_add, a, MAX_LEN, vocab, HASH_BS, "ops", 3)
    assert fast == outcome(reference_add, a, vocab)
    if isinstance(fast, AddRequestOp) and fast.token_ids is not None:
        assert fast.token_ids.tolist() == array("I", a.token_ids).tolist()


@given(IDS, TOKENS, NAMES, NAMES, st.sampled_from([0, 0, 0, 5, 16, 80, None]), st.sampled_from([False] * 3 + [True]),
       st.sampled_from([False] * 3 + [True]), st.sampled_from([0, VOCAB]))
def test_decode_add_equals_its_rules_one_by_one(request_id, tokens, salt, lora, num_tokens, with_hashes,
                                                        with_mm, vocab):
    n = len(tokens) // 4 if num_tokens is None else num_tokens  # None: the matching count
    a = pb.AddRequestOp(request_id=request_id, token_ids=tokens, cache_salt=salt, lora_name=lora, num_tokens=n)
    if with_hashes:
        a.block_hashes = bytes(16 * (n // HASH_BS))
    if with_mm:
        a.mm_items.add(identifier="img", offset=0, length=2)
    check_add(a, vocab)


def test_decode_add_edge_ids_and_names():
    tokens = array("I", range(20)).tobytes()
    for request_id in EDGE_IDS:
        for salt in EDGE_NAMES:
            check_add(pb.AddRequestOp(request_id=request_id, token_ids=tokens, cache_salt=salt), VOCAB)
            check_add(pb.AddRequestOp(request_id=request_id, token_ids=tokens, lora_name=salt), 0)
    for num_tokens in (0, 19, 20, 21, 64, 65):
        for n in (19, 20, 64, 65):
            tokens = array("I", range(n)).tobytes()
            check_add(pb.AddRequestOp(request_id="r", token_ids=tokens, num_tokens=num_tokens), 0)
    for bad in ((1000,), (999, 1000), (2**32 - 1,)):
        check_add(pb.AddRequestOp(request_id="r", token_ids=array("I", [1] * 40 + list(bad)).tobytes()), VOCAB)


@given(st.lists(IDS, max_size=40))
def test_decode_batch_rejects_the_first_bad_id_by_name(request_ids):
    d = pb.DecodeBatchOp(request_ids=request_ids, num_computed_tokens=array("I", [1] * len(request_ids)).tobytes())
    expected = None
    for j, rid in enumerate(request_ids):
        try:
            check_id(f"ops[0].decode.request_ids[{j}]", rid)
        except InvalidArgument as exc:
            expected = ("InvalidArgument", str(exc))
            break
    got = outcome(decode_batch, d, MAX_LEN, 0, "ops[0].decode")
    if expected is not None:
        assert got == expected
    else:
        assert isinstance(got, DecodeBatchOp) and got.request_ids == request_ids


@pytest.mark.parametrize("values", [[5] * 31 + [65], [5] * 40 + [65], [65] + [5] * 40, [64] * 50])
def test_decode_batch_bounds_num_computed_tokens(values):
    d = pb.DecodeBatchOp(request_ids=[f"r{i}" for i in range(len(values))],
                         num_computed_tokens=array("I", values).tobytes())
    got = outcome(decode_batch, d, MAX_LEN, 0, "f")
    if max(values) > MAX_LEN:
        j = next(j for j, v in enumerate(values) if v > MAX_LEN)
        assert got == ("InvalidArgument", f"f.num_computed_tokens[{j}] = 65: exceeds max_model_len {MAX_LEN}")
    else:
        assert got.num_computed_tokens == values


def admit_msg(op: AdmitBatchOp) -> pb.AdmitBatchOp:
    msg = pb.Op()
    encode_op(op, msg)
    return msg.admit


def test_admit_batch_round_trip():
    op = AdmitBatchOp(["a", "b", "c"], [[1, 2, 3], [4], list(range(60))], [3, 0, 17], 2, ["s", None, ""],
                      None)
    back = decode_admit(admit_msg(op), MAX_LEN, VOCAB, "f")
    assert back.request_ids == op.request_ids and [p.tolist() for p in back.prompts] == op.prompts
    assert back.num_new_tokens == [3, 0, 17] and back.num_lookahead_tokens == 2
    assert back.cache_salts == ["s", None, None] and back.lora_names is None
    whole = decode_admit(admit_msg(AdmitBatchOp(["a"], [[5, 6]])), MAX_LEN, 0, "f")
    assert whole.num_new_tokens is None and whole.cache_salts is None


@pytest.mark.parametrize("mangle, error", [
    (lambda m: setattr(m, "num_prompt_tokens", array("I", [3, 1]).tobytes()),
     "f.num_prompt_tokens = '<2 values>': needs one uint32 per request (3)"),
    (lambda m: setattr(m, "num_prompt_tokens", array("I", [3, 0, 1]).tobytes()),
     "f.num_prompt_tokens[1] = 0: is below 1"),
    (lambda m: setattr(m, "num_prompt_tokens", array("I", [3, 1, 65]).tobytes()),
     "f.num_prompt_tokens[2] = 65: exceeds max_model_len 64"),
    (lambda m: setattr(m, "token_ids", m.token_ids[:-4]), "f.token_ids = '<5 tokens>': num_prompt_tokens add up to 6"),
    (lambda m: setattr(m, "token_ids", m.token_ids + b"\0"), "f.token_ids = '<25 bytes>'"),
    (lambda m: setattr(m, "token_ids", array("I", [1, 2, 1000, 4, 5, 6]).tobytes()),
     "f.token_ids[2] = 1000: token id out of range for vocab_size 1000"),
    (lambda m: setattr(m, "num_new_tokens", array("I", [1, 65, 1]).tobytes()),
     "f.num_new_tokens[1] = 65: exceeds max_model_len 64"),
    (lambda m: setattr(m, "num_lookahead_tokens", 65), "f.num_lookahead_tokens = 65: exceeds max_model_len 64"),
    (lambda m: m.cache_salts.extend(["a", "b"]), "f.cache_salts = '<2 names>': give none or one per request (3)"),
    (lambda m: m.lora_names.extend(["", "x" * 257, ""]), "f.lora_names[1] = 'xxx"),
    (lambda m: m.request_ids.__setitem__(1, ""), "f.request_ids[1] = '': must not be empty"),
])
def test_admit_batch_rejects_by_field_and_value(mangle, error):
    msg = admit_msg(AdmitBatchOp(["a", "b", "c"], [[1, 2, 3], [4], [5, 6]]))
    decode_admit(msg, MAX_LEN, VOCAB, "f")  # well-formed as built
    mangle(msg)
    with pytest.raises(InvalidArgument) as exc:
        decode_admit(msg, MAX_LEN, VOCAB, "f")
    assert str(exc.value).startswith(error)
