"""Auth, admin, tenant isolation, quotas, TLS and mTLS against real server processes."""

import datetime
import ipaddress
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvservice.client.routing import open_channel
from kvservice.errors import Code, InvalidArgument, KVServiceError, PermissionDenied, Unauthenticated, Unavailable
from kvservice.ops import AddRequestOp, AllocateOp, OpStatus
from tests.service_helpers import small_config, start_server

TOKENS = "tok-a tenant-a\ntok-b tenant-b\ntok-admin ops admin\n"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("auth")
    (d / "tokens").write_text(TOKENS)
    proc = start_server("--token-file", str(d / "tokens"), "--quota", "tenant-b=6", log_dir=d)
    yield proc
    proc.stop()


def test_missing_and_wrong_tokens_are_unauthenticated(secured):
    for token in (None, "nope"):
        c = secured.client(token, retries=0)
        with pytest.raises(Unauthenticated):
            c.get_stats()
        with pytest.raises(Unauthenticated):
            c.open_session()
        c.close()
    # The watch stream is guarded too.
    c = secured.client("nope", retries=0)
    with pytest.raises(Unauthenticated):
        next(iter(c.watch_events(timeout_s=5)))
    c.close()


def test_health_and_reflection_are_exempt(secured):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    with open_channel(secured.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=5))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"kvservice.v1.Allocator", "grpc.health.v1.Health"} <= names


def test_reset_needs_an_admin_token(secured):
    user = secured.client("tok-a")
    with pytest.raises(PermissionDenied, match="not an admin"):
        user.reset_prefix_cache()
    admin = secured.client("tok-admin")
    admin.reset_prefix_cache()
    user.close()
    admin.close()


def test_tenants_never_share_prefixes_requests_or_events(secured):
    a, b = secured.client("tok-a"), secured.client("tok-b")
    a.register_pool("pool-a", small_config(64, 16), max_model_len=512)
    b.register_pool("pool-b", small_config(64, 16), max_model_len=512)
    prompt = list(range(64))
    start = a.get_stats().event_sequence + 1
    r = a.step("pool-a", [AddRequestOp("r", token_ids=prompt), AllocateOp("r", num_new_tokens=64)])
    a_blocks = set(r[1].new_block_ids[0])
    # Same request id, same prompt, even the same client-computed hashes: no hit in b's own pool.
    r = b.step("pool-b", [AddRequestOp("r", block_hashes=b.hash_prompt(prompt), num_tokens=64),
                          AllocateOp("r", num_new_tokens=64)])
    assert r[0].status == OpStatus.OK and r[1].num_computed_tokens == 0
    # Each tenant's Lookup sees only its own pools.
    assert {h.pool_id for h in a.lookup(prompt + [1]).hits} == {"pool-a"}
    assert {h.pool_id for h in b.lookup(prompt).hits} == {"pool-b"}
    assert a.lookup(prompt + [1]).tokens("pool-a") == 64
    # Tenant a's own repeat hits its own blocks.
    r = a.step("pool-a", [AddRequestOp("r2", token_ids=prompt), AllocateOp("r2", num_new_tokens=64)])
    assert r[1].num_computed_tokens == 48
    a_blocks |= set(r[1].new_block_ids[0])
    # Each tenant sees only its own events, in its own (tenant-free) hashes.
    seen_a = [e for e in _drain(a, start)]
    seen_b = [e for e in _drain(b, start, "pool-b")]
    assert seen_a and seen_b
    assert {e.pool_id for e in seen_a} == {"pool-a"} and {e.pool_id for e in seen_b} == {"pool-b"}
    assert {h for e in seen_a for h in e.block_hashes} == set(a.hash_prompt(prompt))
    assert all(set(e.block_ids) <= a_blocks for e in seen_a)
    a.free("pool-a", "r", "r2")
    b.free("pool-b", "r")
    a.close()
    b.close()


def _drain(client, start, pool_id="pool-a"):
    """Every event of `pool_id` visible to `client` from `start` (the stream stays open: read until a deadline)."""
    out = []
    try:
        for e in client.watch_events([pool_id], start_sequence=start, timeout_s=2):
            out.append(e)
    except KVServiceError as exc:
        assert exc.code == Code.DEADLINE_EXCEEDED
    return out


def test_sessions_belong_to_their_tenant(secured):
    a, b = secured.client("tok-a"), secured.client("tok-b")
    a.open_session()
    b.session_id = a.session_id
    b.next_sequence = a.next_sequence
    with pytest.raises(PermissionDenied, match="another tenant"):
        b.heartbeat()
    a.close()
    b.close()


def test_tenant_block_quota(secured):
    b = secured.client("tok-b")
    b.register_pool("quota", small_config(64, 16), max_model_len=512)
    r = b.step("quota", [AddRequestOp("q1", token_ids=list(range(64))), AllocateOp("q1", num_new_tokens=64)])
    assert r[1].status == OpStatus.OK  # 4 blocks of a quota of 6
    r = b.step("quota", [AddRequestOp("q2", token_ids=list(range(1000, 1048))), AllocateOp("q2", num_new_tokens=48)])
    assert r[1].status == OpStatus.RESOURCE_EXHAUSTED
    assert "4 held + 3 needed > quota 6" in r[1].message
    # A fork shares blocks: it costs nothing against the quota.
    assert b.fork("quota", "q1", "q1-child")[0].status == OpStatus.OK
    b.free("quota", "q1", "q1-child", "q2")
    r = b.step("quota", [AddRequestOp("q3", token_ids=list(range(2000, 2096))), AllocateOp("q3", num_new_tokens=96)])
    assert r[1].status == OpStatus.OK  # 6 blocks: exactly the quota once the others are freed
    b.free("quota", "q3")
    b.close()


# ---- TLS ------------------------------------------------------------------------------------------
def _cert(subject: str, issuer_key, issuer_name, key, ca: bool = False, server: bool = False):
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path, cert=None, key=None):
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("kvservice test CA", ca_key, None, ca_key, ca=True)
    files = {"ca": _write(d / "ca.pem", cert=ca)}
    for who, server in (("server", True), ("client", False)):
        key = ec.generate_private_key(ec.SECP256R1())
        files[f"{who}_key"] = _write(d / f"{who}.key", key=key)
        files[f"{who}_cert"] = _write(d / f"{who}.pem", cert=_cert(who, ca_key, ca.subject, key, server=server))
    other_key = ec.generate_private_key(ec.SECP256R1())
    rogue = _cert("rogue", other_key, None, other_key)
    files["rogue_key"] = _write(d / "rogue.key", key=other_key)
    files["rogue_cert"] = _write(d / "rogue.pem", cert=rogue)
    files["dir"] = d
    return files


def test_tls_server(pki):
    proc = start_server("--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], log_dir=pki["dir"])
    try:
        c = proc.client(tls_ca=pki["ca"])
        assert c.get_stats().persistence in ("off", "ok", "degraded")
        c.close()
        plain = proc.client(retries=0, timeout_s=3)
        with pytest.raises(Unavailable):
            plain.get_stats()
        plain.close()
    finally:
        proc.stop()


def test_mutual_tls_requires_a_client_certificate(pki):
    proc = start_server("--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], "--tls-ca", pki["ca"],
                        log_dir=pki["dir"])
    try:
        good = proc.client(tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"])
        good.register_pool("mtls", small_config(), max_model_len=256)
        good.close()
        for cert, key in ((None, None), (pki["rogue_cert"], pki["rogue_key"])):
            bad = proc.client(tls_ca=pki["ca"], tls_cert=cert, tls_key=key, retries=0, timeout_s=3)
            with pytest.raises(Unavailable):
                bad.get_stats()
            bad.close()
        # `kvservice status` speaks mutual TLS too (issue 13, point 11).
        status = [sys.executable, "-m", "kvservice.cli", "status", "--target", proc.target, "--tls-ca", pki["ca"]]
        ok = subprocess.run([*status, "--tls-cert", pki["client_cert"], "--tls-key", pki["client_key"]],
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and "mtls" in ok.stdout, ok.stderr
        refused = subprocess.run(status, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr and "--tls-cert" in refused.stderr
    finally:
        proc.stop()


def test_requests_per_session_limit(tmp_path):
    proc = start_server("--max-requests-per-session", "3", log_dir=tmp_path)
    try:
        c = proc.client()
        c.register_pool("limited", small_config(64, 16), max_model_len=512)
        r = c.step("limited", [AddRequestOp(f"r{i}", token_ids=[1, 2, 3]) for i in range(4)])
        assert [x.status for x in r.results] == [OpStatus.OK] * 3 + [OpStatus.RESOURCE_EXHAUSTED]
        assert "holds 3 requests, the limit is 3" in r[3].message
        c.free("limited", "r0")
        assert c.step("limited", [AddRequestOp("r3", token_ids=[1])])[0].status == OpStatus.OK
    finally:
        proc.stop()


def test_every_rpc_requires_a_token(secured):
    """Not just a few: every method of the service answers UNAUTHENTICATED without a valid token."""
    from kvservice._proto import allocator_pb2 as pb
    with open_channel(secured.target) as channel:
        for method in pb.DESCRIPTOR.services_by_name["Allocator"].methods:
            request = method.input_type._concrete_class().SerializeToString()
            path = f"/kvservice.v1.Allocator/{method.name}"
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                if method.server_streaming:
                    call = channel.unary_stream(path)
                    with pytest.raises(grpc.RpcError) as info:
                        next(iter(call(request, metadata=metadata, timeout=5)))
                else:
                    call = channel.unary_unary(path)
                    with pytest.raises(grpc.RpcError) as info:
                        call(request, metadata=metadata, timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method.name


def test_pools_belong_to_the_tenant_that_registered_them(secured):
    a, b, admin = secured.client("tok-a"), secured.client("tok-b"), secured.client("tok-admin")
    a.register_pool("owned", small_config(64, 16), max_model_len=512, epoch=1)
    a.step("owned", [AddRequestOp("r", token_ids=list(range(40))), AllocateOp("r", num_new_tokens=40)])
    with pytest.raises(PermissionDenied, match="belongs to another tenant"):
        b.register_pool("owned", small_config(64, 16), max_model_len=512, epoch=2)
    # A stale resume by another tenant naming the pool does not wipe it.
    b.session_id, b.next_sequence = "no-such-session", 1
    from kvservice._proto import allocator_pb2 as pb
    reply = b.stub.OpenSession(pb.OpenSessionRequest(resume_session_id="no-such-session", last_acked_sequence=9,
                                                     resume_pool_ids=["owned"]), metadata=b.metadata, timeout=5)
    assert list(reply.pools_failed) == []
    assert a.get_request("owned", "r").num_tokens == 40 and a.get_stats().pools["owned"].epoch == 1
    # An admin may start a new epoch of anyone's pool.
    assert admin.register_pool("owned", small_config(64, 16), max_model_len=512, epoch=2).new_epoch
    for c in (a, b, admin):
        c.close()


def test_pool_size_limit(tmp_path):
    proc = start_server("--max-pool-blocks", "1000", log_dir=tmp_path)
    try:
        c = proc.client()
        with pytest.raises(InvalidArgument, match=r"config.num_blocks = 1001: exceeds this allocator's limit of 1000"):
            c.register_pool("huge", small_config(1001, 16), max_model_len=512)
        c.register_pool("fine", small_config(1000, 16), max_model_len=512)
    finally:
        proc.stop()
