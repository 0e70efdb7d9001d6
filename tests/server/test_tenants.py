"""Tenants (server/http/tenants.py, docs/server.md "Tenants"): the file, keys, scoping (404 outside a tenant's names,
403 on admin routes), a prefix cache per tenant, quotas with Retry-After, a SIGHUP reload, and the engine's fair
queue over tenants is tested in tests/engine/test_fair_queue.py."""
import hmac
import os
import signal

import httpx
import openai
import pytest

from loramux.cli import main as cli_main
from loramux.server.http import tenants as tenants_module
from loramux.server.http.errors import HTTPError
from loramux.server.http.tenants import Quotas, Tenant, check_admin, check_use, key_hash, load_dirs, load_tenants
from support.hostile_adapters import CONFIG, ST
from support.serving import NO_KEEPALIVE, make_files, openai_client, start_server, stop, wait_until

OPERATOR = "operator-key"
KEYS = {"acme": "acme-key", "beta": "beta-key", "gamma": "gamma-key"}


def tenants_toml(allowed: str, gamma: bool = False) -> str:
    text = f"""
[tenants.acme]
keys = ["sha256:{key_hash(KEYS['acme'])}"]
models = ["s0", "shared*", "acme/*"]
admin = true
adapter_dir = "{allowed}"

[tenants.beta]
keys = ["sha256:{key_hash(KEYS['beta'])}"]
models = ["tiny", "s2", "shared*", "s3"]
rpm_limit = 3
"""
    if gamma:
        text += f'\n[tenants.gamma]\nkeys = ["sha256:{key_hash(KEYS["gamma"])}"]\nmodels = ["s4"]\n'
    return text


# ---- the file ----------------------------------------------------------------------------------------------
def test_a_tenants_file_reads_and_every_mistake_is_named(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(tenants_toml(str(tmp_path)))
    tenants = load_tenants(str(path))
    acme, beta = tenants.tenants
    assert acme.admin and acme.adapter_dir == os.path.realpath(tmp_path) and beta.rpm_limit == 3 and not beta.admin
    assert acme.may_use("acme/legal") and acme.may_use("shared-1") and not acme.may_use("tiny")
    assert tenants.find(KEYS["beta"]) is beta and tenants.find("nope") is None
    mistakes = {
        'keys = ["acme-key"]': "never the key itself",
        'keys = []': "non-empty",
        'keys = ["sha256:abc"]\nmodels = ["x"]': "64 hex digits",
        f'keys = ["sha256:{key_hash("k")}"]\nweight = 0': "weight must be a number > 0",
        f'keys = ["sha256:{key_hash("k")}"]\nrpm_limit = 0': "rpm_limit must be an integer >= 1",
        f'keys = ["sha256:{key_hash("k")}"]\nspeed = 1': "unknown field(s) speed",
        f'keys = ["sha256:{key_hash("k")}"]\nadapter_dir = "/no/such/dir"': "is not a directory",
        f'keys = ["sha256:{key_hash("k")}"]\nmodels = "x"': "models must be a list of strings",
    }
    for body, message in mistakes.items():
        path.write_text(f"[tenants.t]\n{body}\n")
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_tenants(str(path))
    path.write_text(f'[tenants.a]\nkeys = ["sha256:{key_hash("k")}"]\n[tenants.b]\nkeys = ["sha256:{key_hash("k")}"]\n')
    with pytest.raises(ValueError, match="share a key"):
        load_tenants(str(path))
    path.write_text("[tenants.a\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_tenants(str(path))


def test_a_key_is_compared_with_every_hash_in_constant_time(tmp_path, monkeypatch):
    path = tmp_path / "tenants.toml"
    path.write_text(tenants_toml(str(tmp_path), gamma=True))
    tenants = load_tenants(str(path))
    compared, real = [], hmac.compare_digest
    monkeypatch.setattr(tenants_module.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    assert tenants.find(KEYS["acme"]).name == "acme"  # the first tenant: the others are compared all the same
    assert len(compared) == 3 and tenants.find("wrong") is None and len(compared) == 6


def test_tenant_key_prints_a_key_whose_hash_line_reads_back(tmp_path, capsys):
    cli_main(["tenant-key", "acme"])
    out = capsys.readouterr().out.splitlines()
    key, table = out[1].strip(), "\n".join(out[-2:])
    path = tmp_path / "t.toml"
    path.write_text(table + '\nmodels = ["acme/*"]\n')
    assert key.startswith("lmx-") and key not in path.read_text()
    assert load_tenants(str(path)).find(key).name == "acme"


# ---- the rules -----------------------------------------------------------------------------------------------
def test_names_outside_a_tenant_are_404_and_admin_outside_is_403():
    acme = Tenant("acme", ("0" * 64,), ("acme/*",), admin=True, adapter_dir="/srv/acme")
    viewer = Tenant("viewer", ("1" * 64,), ("acme/*",))
    check_use(acme, "acme/legal")
    check_use(None, "anything")  # the operator
    with pytest.raises(HTTPError) as outside:
        check_use(acme, "beta/legal")
    assert outside.value.status_code == 404 and outside.value.code == "model_not_found"
    check_admin(acme, "acme/x")
    for tenant, name in ((viewer, "acme/x"), (acme, "beta/x"), (acme, None)):
        with pytest.raises(HTTPError) as refused:
            check_admin(tenant, name)
        assert refused.value.status_code == 403
    assert load_dirs(acme, ("/op",)) == ("/srv/acme",) and load_dirs(None, ("/op",)) == ("/op",)
    with pytest.raises(HTTPError, match="no adapter_dir"):
        load_dirs(viewer, ("/op",))


def test_quotas_refuse_past_each_limit_with_retry_after_from_the_window():
    now = [1000.0]
    quotas = Quotas(clock=lambda: now[0])
    tenant = Tenant("t", ("0" * 64,), max_parallel_requests=2, rpm_limit=3, tpm_limit=100)
    quotas.admit(tenant)
    quotas.admit(tenant)
    with pytest.raises(HTTPError) as parallel:
        quotas.admit(tenant)
    assert parallel.value.status_code == 429 and parallel.value.code == "max_parallel_requests"
    quotas.finished(tenant, 30)
    now[0] += 20
    quotas.finished(tenant, 80)  # 110 tokens in the last minute: over tpm_limit 100
    with pytest.raises(HTTPError) as tpm:
        quotas.admit(tenant)
    assert tpm.value.code == "tpm_limit" and tpm.value.headers["Retry-After"] == "40"  # the first 30 leave at 1060
    now[0] += 41  # 1061: 80 tokens in the window, and no request (those at 1000 left it)
    for step in (0, 10, 10):
        now[0] += step
        quotas.admit(tenant)
        quotas.finished(tenant, 0)
    with pytest.raises(HTTPError) as rpm:
        quotas.admit(tenant)
    assert rpm.value.code == "rpm_limit" and "tenant 't' is over its rpm_limit of 3" in rpm.value.message
    assert rpm.value.headers["Retry-After"] == "40"  # the window's first (at 1061) leaves at 1121; now is 1081
    now[0] += 40
    quotas.admit(tenant)


# ---- over HTTP ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    files = make_files(tmp_path_factory)
    files["served"]["shared"] = files["served"]["s1"]
    return files


@pytest.fixture(scope="module")
def server(files):
    path = files["root"] / "tenants.toml"
    path.write_text(tenants_toml(files["allowed"]))
    proc, url = start_server(files, "--api-key", OPERATOR, "--tenants", str(path), "--max-adapter-upload-bytes",
                             str(1 << 20))
    yield proc, url, path
    stop(proc)


def http(url: str, who: str) -> httpx.Client:
    key = OPERATOR if who == "operator" else KEYS[who]
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60, limits=NO_KEEPALIVE)


def complete(client: httpx.Client, model: str, prompt: str = "hi", **extra) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                **extra})


def test_a_tenant_reaches_its_names_only_and_others_look_absent(server):
    _, url, _ = server
    acme, beta, op = http(url, "acme"), http(url, "beta"), http(url, "operator")
    assert complete(acme, "s0").status_code == 200
    outside, absent = complete(acme, "s2"), complete(acme, "no-such-adapter")
    assert outside.status_code == absent.status_code == 404
    assert outside.json()["error"]["message"].replace("s2", "X") == absent.json()["error"]["message"].replace(
        "no-such-adapter", "X")  # no existence oracle
    assert complete(acme, "tiny").status_code == 404  # the base model: only where its patterns list it
    assert complete(beta, "tiny").status_code == 200 and complete(op, "s2").status_code == 200
    assert acme.get("/v1/models/s2").status_code == 404 and beta.get("/v1/models/s2").status_code == 200
    assert acme.post("/tokenize", json={"model": "s3", "prompt": "x"}).status_code == 404
    listed = {m["id"] for m in acme.get("/v1/models").json()["data"]}
    assert listed == {"s0", "shared"}
    assert {m["id"] for m in beta.get("/v1/models").json()["data"]} == {"tiny", "s2", "s3", "shared"}
    assert len(op.get("/v1/models").json()["data"]) == 7
    unknown = httpx.post(f"{url}/v1/completions", json={"model": "s0", "prompt": "x"},
                         headers={"Authorization": "Bearer nope"})
    assert unknown.status_code == 401 and httpx.get(f"{url}/health").status_code == 200


def test_admin_routes_are_scoped_to_a_tenants_names_and_directory(server, files, tmp_path):
    _, url, _ = server
    acme, beta, op = http(url, "acme"), http(url, "beta"), http(url, "operator")
    new = files["runtime"]["new"]
    assert beta.post("/v1/load_lora_adapter", json={"lora_name": "s2", "lora_path": new}).status_code == 403
    refused = acme.post("/v1/load_lora_adapter", json={"lora_name": "beta/new", "lora_path": new})
    assert refused.status_code == 403 and "outside its models" in refused.json()["error"]["message"]
    outside_dir = acme.post("/v1/load_lora_adapter", json={"lora_name": "acme/x", "lora_path": files["served"]["s0"]})
    assert outside_dir.status_code == 400 and "outside the allowed" in outside_dir.json()["error"]["message"]
    assert acme.post("/v1/load_lora_adapter", json={"lora_name": "acme/new", "lora_path": new}).status_code == 200
    assert complete(acme, "acme/new").status_code == 200 and complete(beta, "acme/new").status_code == 404
    assert acme.post("/v1/pin_lora_adapter", json={"lora_name": "acme/new"}).status_code == 200
    assert acme.post("/v1/unpin_lora_adapter", json={"lora_name": "s2"}).status_code == 403
    assert acme.post("/v1/unload_lora_adapter", json={"lora_name": "s2"}).status_code == 403
    assert acme.post("/v1/unload_lora_adapter", json={"lora_name": "acme/new"}).status_code == 200
    for route in ("/pause", "/resume", "/reset_prefix_cache"):
        assert acme.post(route).status_code == 403
    assert acme.get("/metrics").status_code == 403 and acme.get("/is_paused").status_code == 403
    assert op.get("/metrics").status_code == 200


def test_uploads_are_scoped_as_loads_are_and_a_refused_one_leaves_no_files(server, files):
    _, url, _ = server
    acme, beta = http(url, "acme"), http(url, "beta")
    adapter = files["runtime"]["new"]

    def upload(client, name):
        with open(os.path.join(adapter, CONFIG), "rb") as config, open(os.path.join(adapter, ST), "rb") as weights:
            return client.post("/v1/load_lora_adapter", data={"lora_name": name},
                               files={CONFIG: (CONFIG, config), ST: (ST, weights)})

    assert upload(acme, "acme/pushed").status_code == 200
    directory = os.path.dirname(acme.get("/v1/models/acme/pushed").json()["root"])  # the server's uploads
    before = sorted(os.listdir(directory))
    not_admin, outside = upload(beta, "s2"), upload(acme, "beta/pushed")
    assert not_admin.status_code == outside.status_code == 403
    assert "admin is off" in not_admin.json()["error"]["message"]
    assert "outside its models" in outside.json()["error"]["message"]
    assert sorted(os.listdir(directory)) == before  # the bodies were written as they came, then removed
    assert acme.post("/v1/unload_lora_adapter", json={"lora_name": "acme/pushed"}).status_code == 200


def test_tenants_never_share_prefix_cache_blocks_and_a_salt_splits_one_tenants(server):
    _, url, _ = server
    prompt = "a prompt two tenants both send: " + "z" * 14  # 46 characters: 2 full blocks of 16 before the last

    def cached(who, model="shared", salt=None):
        extra = {} if salt is None else {"cache_salt": salt}
        out = complete(http(url, who), model, prompt, **extra)
        assert out.status_code == 200, out.text
        return out.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("acme") == 0 and cached("acme") == 32  # its own blocks
    assert cached("beta") == 0 and cached("beta") == 32  # not acme's
    assert cached("operator") == 0  # nor the operator's
    assert cached("acme", salt="user-1") == 0 and cached("acme", salt="user-1") == 32


def test_a_tenant_over_its_rpm_limit_gets_429_with_retry_after_and_others_go_on(server):
    _, url, _ = server
    beta, acme = http(url, "beta"), http(url, "acme")
    answers = [complete(beta, "s2") for _ in range(4)]  # rpm_limit 3 (other tests' requests count too)
    refused = answers[-1]
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rpm_limit"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert complete(acme, "s0").status_code == 200
    metrics = http(url, "operator").get("/metrics").text
    assert 'loramux:tenant_rejected_total{limit="rpm_limit",tenant="beta"}' in metrics
    assert 'loramux:tenant_tokens_total{tenant="acme"}' in metrics


def test_sighup_reloads_the_tenants_file_and_a_bad_file_keeps_the_old_one(server, files):
    proc, url, path = server
    gamma = openai_client(url, KEYS["gamma"])
    with pytest.raises(openai.AuthenticationError):
        gamma.models.list()
    path.write_text("[tenants.broken\n")
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "tenants not reloaded" in open(proc.log.name).read(), 60, "the bad file logged")
    assert complete(http(url, "acme"), "s0").status_code == 200  # the old tenants stay
    path.write_text(tenants_toml(files["allowed"], gamma=True))
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: http(url, "gamma").get("/v1/models").status_code == 200, 60, "gamma's key works")
    assert [m.id for m in gamma.models.list().data] == ["s4"]
    assert KEYS["gamma"] not in open(proc.log.name).read()  # keys are never logged


def test_a_tenants_keys_and_addresses_are_one_client_for_limits_and_shares_and_no_key_reaches_the_engine():
    """Per-client limits (requests in flight, cold names resolving: a flood of unknown names waits its turn
    behind its own) and the engine's fair share key on the tenant, whichever of its keys or addresses a
    request comes from; without tenants, on the key, sent to the engine only as a digest."""
    from starlette.requests import Request

    from loramux.server.http.api_server import client_of, share_of

    acme = Tenant("acme", ("0" * 64,), ("acme/*",))

    def request(key: str, host: str, tenant=None):
        scope = {"type": "http", "headers": [(b"authorization", f"Bearer {key}".encode())], "client": (host, 1),
                 "state": {"tenant": tenant}}
        return Request(scope)

    assert client_of(request("k1", "10.0.0.1", acme)) == client_of(request("k2", "10.0.0.2", acme)) == "tenant:acme"
    assert share_of("tenant:acme") == "tenant:acme"
    plain = client_of(request("secret-key", "10.0.0.1"))
    assert plain == "Bearer secret-key" and "secret" not in share_of(plain)
    assert share_of(plain) != share_of(client_of(request("other-key", "10.0.0.1")))
