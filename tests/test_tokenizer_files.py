"""A Hugging Face hub name for --tokenizer-model, checked before the load: a name in the local
Hugging Face cache goes through; one that is not is refused in one line, at once, when the
hub cannot be asked (HF_HUB_OFFLINE) or does not answer one probe.

The hub is a real socket on this machine (a closed port, a server that never answers, an
HTTP server) and the cache a real folder in huggingface_hub's layout; nothing else is asked."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from megagpt.data import tokenizer_files as TF
from megagpt.data.tokenizer_files import TokenizerError, check_tokenizer_files
from megagpt.data.tokenizers import tokenizer_namespace

# What huggingface_hub reads to find its cache, go offline or reach the hub (urllib reads the
# proxy variables the same way).
HUB_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME",
                 "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "http_proxy",
                 "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
REVISION = "607a30d783dfa663caf39e06633721c8d4cfcd7e"  # a commit id, as refs/main holds one
# The old time: huggingface_hub retried each file about a minute before transformers gave up.
WELL_UNDER_THE_RETRIES_S = 10


def hf_args(model: str):
    return tokenizer_namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=model)


def hub_cache_entry(cache, repo_id: str, files: dict[str, bytes]) -> str:
    """``repo_id``'s main revision written into the hub cache folder ``cache`` as
    huggingface_hub writes it: blobs, a snapshot of links to them, refs/main naming the
    snapshot. The snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return str(snapshot)


def gpt2_hub_files(gpt2) -> dict[str, bytes]:
    """The files transformers reads for the hub's ``gpt2``: GPT-2's vocab.json and
    merges.txt, tokenizer_config.json, and config.json, which names the model type (its
    AutoTokenizer reads the config first and picks the tokenizer class by it)."""
    return {"vocab.json": open(gpt2.vocab_file, "rb").read(),
            "merges.txt": open(gpt2.merge_file, "rb").read(),
            "tokenizer_config.json": json.dumps({"model_max_length": 1024}).encode(),
            "config.json": json.dumps({"model_type": "gpt2"}).encode()}


@pytest.fixture
def hf_cache(monkeypatch, tmp_path):
    """An empty Hugging Face home under tmp_path, online, without proxies; its hub cache."""
    for var in HUB_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf" / "hub"


@pytest.fixture
def closed_port():
    """A local port bound but not listening: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


class SilentHub:
    """A local server that accepts connections and never answers; counts them."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:  # closed
                return

    def close(self):
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def silent_hub():
    hub = SilentHub()
    yield hub
    hub.close()


@pytest.fixture
def answering_hub():
    """A local HTTP server that answers each request with 200; ``requests`` counts them."""
    requests = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            requests.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    server.requests = requests
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()


def test_uncached_name_and_an_unreachable_hub_is_one_line_at_once(hf_cache, closed_port,
                                                                  monkeypatch):
    endpoint = f"http://127.0.0.1:{closed_port}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint + "/")
    probes = []
    real_probe = TF.probe_hub
    monkeypatch.setattr(TF, "probe_hub", lambda url: probes.append(url) or real_probe(url))
    start = time.monotonic()
    with pytest.raises(TokenizerError) as err:
        check_tokenizer_files(hf_args("gpt2"))
    assert time.monotonic() - start < WELL_UNDER_THE_RETRIES_S
    assert probes == [endpoint]  # asked once, no retries
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"--tokenizer-model gpt2: not in the local Hugging Face cache "
                              f"({hf_cache}) and the hub cannot be reached ({endpoint}: ")
    assert "Connection refused" in message
    assert "`hf download gpt2`" in message and "--tokenizer-model DIR" in message


def test_a_hub_that_does_not_answer_is_asked_once_within_the_timeout(hf_cache, silent_hub,
                                                                     monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", silent_hub.url)
    monkeypatch.setattr(TF, "HUB_PROBE_TIMEOUT_S", 0.5)
    start = time.monotonic()
    with pytest.raises(TokenizerError, match=r"the hub cannot be reached \(http://127\.0\.0\.1:"
                                             r"\d+: (no answer within 0\.5 s|timed out)\)"):
        check_tokenizer_files(hf_args("openai-community/gpt2"))
    assert time.monotonic() - start < WELL_UNDER_THE_RETRIES_S
    assert len(silent_hub.accepted) == 1


def test_a_hub_that_accepts_and_never_answers_timed_out(silent_hub):
    """The request itself, without the probe's wait around it: connected, no answer on the
    read, said as a connection's timeout says it."""
    assert TF._request(silent_hub.url, 0.3) == "timed out"


@pytest.mark.parametrize("variable,value", [("HF_HUB_OFFLINE", "1"),
                                            ("TRANSFORMERS_OFFLINE", "yes")])
def test_offline_and_uncached_is_refused_without_asking_the_hub(hf_cache, silent_hub,
                                                                monkeypatch, variable, value):
    monkeypatch.setenv("HF_ENDPOINT", silent_hub.url)
    monkeypatch.setenv(variable, value)
    with pytest.raises(TokenizerError) as err:
        check_tokenizer_files(hf_args("gpt2"))
    assert str(err.value).startswith(
        f"--tokenizer-model gpt2: not in the local Hugging Face cache ({hf_cache}) and "
        f"{variable}={value} keeps the hub from being asked; download it where there is "
        "internet (`hf download gpt2`)")
    time.sleep(0.2)  # a connection made would have been accepted by now
    assert silent_hub.accepted == []


def test_offline_off_is_read_as_huggingface_hub_reads_it(hf_cache, answering_hub, monkeypatch):
    """HF_HUB_OFFLINE=0 wins over TRANSFORMERS_OFFLINE=1 there: the hub is asked."""
    monkeypatch.setenv("HF_ENDPOINT", answering_hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    check_tokenizer_files(hf_args("gpt2"))
    assert answering_hub.requests == ["/"]


def test_uncached_name_and_a_reachable_hub_is_left_to_megatron(hf_cache, answering_hub,
                                                              monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", answering_hub.url)
    check_tokenizer_files(hf_args("gpt2"))
    assert answering_hub.requests == ["/"]


@pytest.mark.parametrize("offline", [None, "1"])
@pytest.mark.parametrize("name", ["gpt2", "openai-community/gpt2"])
def test_cached_name_goes_through_without_asking_the_hub(gpt2, hf_cache, silent_hub,
                                                         monkeypatch, offline, name):
    hub_cache_entry(hf_cache, name, gpt2_hub_files(gpt2))
    monkeypatch.setenv("HF_ENDPOINT", silent_hub.url)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    check_tokenizer_files(hf_args(name))
    time.sleep(0.2)
    assert silent_hub.accepted == []


def test_the_cache_folder_is_read_from_the_variables_as_they_are_now(gpt2, hf_cache, tmp_path,
                                                                     closed_port, monkeypatch):
    """HF_HUB_CACHE over HF_HOME; HF_HOME over XDG_CACHE_HOME; read at the check (after
    huggingface_hub read them at its import)."""
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    hub_cache_entry(hf_cache, "gpt2", gpt2_hub_files(gpt2))
    with pytest.raises(TokenizerError) as err:
        check_tokenizer_files(hf_args("gpt2"))
    assert f"not in the local Hugging Face cache ({tmp_path / 'elsewhere'})" in str(err.value)
    hub_cache_entry(tmp_path / "elsewhere", "gpt2", gpt2_hub_files(gpt2))
    check_tokenizer_files(hf_args("gpt2"))
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert TF.hub_cache_dir() == str(tmp_path / "xdg" / "huggingface" / "hub")


def test_a_snapshot_without_a_tokenizer_file_is_not_cached(hf_cache, closed_port, monkeypatch):
    """A repo whose cached main revision has only, say, config.json: transformers would ask
    the hub for the tokenizer's files."""
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    hub_cache_entry(hf_cache, "gpt2", {"config.json": b'{"model_type": "gpt2"}'})
    with pytest.raises(TokenizerError, match="not in the local Hugging Face cache"):
        check_tokenizer_files(hf_args("gpt2"))


def test_without_huggingface_hub_the_name_is_left_to_megatron(hf_cache, silent_hub,
                                                              monkeypatch):
    """No huggingface_hub to read the cache with: no new requirement, the load says why."""
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # its import raises ImportError
    monkeypatch.setenv("HF_ENDPOINT", silent_hub.url)
    check_tokenizer_files(hf_args("gpt2"))
    time.sleep(0.2)
    assert silent_hub.accepted == []


def test_local_paths_are_not_hub_names(hf_cache, closed_port, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    for missing in ("./gpt2", str(tmp_path / "gpt2"), "a/b/c"):
        with pytest.raises(TokenizerError, match="no such file or folder"):
            check_tokenizer_files(hf_args(missing))


@pytest.mark.slow
def test_a_cached_name_loads_offline_in_a_fresh_process(gpt2, tmp_path, closed_port):
    """The cache folder the tests build is one transformers loads from: the check passes and
    megatron's HuggingFaceTokenizer gives GPT-2's ids, with the hub offline and unreachable."""
    cache = tmp_path / "hub"
    hub_cache_entry(cache, "openai-community/gpt2", gpt2_hub_files(gpt2))
    code = ("from megagpt.data.tokenizer_files import check_tokenizer_files\n"
            "from megagpt.data.tokenizers import build_tokenizer, tokenizer_namespace\n"
            "a = tokenizer_namespace(tokenizer_type='HuggingFaceTokenizer',"
            " tokenizer_model='openai-community/gpt2')\n"
            "check_tokenizer_files(a)\n"
            "print(build_tokenizer(a).tokenize('Hello world'))\n")
    env = {k: v for k, v in os.environ.items() if k not in HUB_VARIABLES}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "home"),
               HF_ENDPOINT=f"http://127.0.0.1:{closed_port}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[15496, 995]"


# A cached name while the hub cannot be asked: loaded from the cache with huggingface_hub
# offline for the load (it would otherwise retry requests for optional files for minutes).

@pytest.fixture(autouse=True)
def _probes_forgotten(monkeypatch):
    """Each test's hub is probed afresh (the module keeps one answer per endpoint a process)."""
    monkeypatch.setattr(TF, "_PROBED", {})


def counted_probes(monkeypatch) -> list[str]:
    probes = []
    real_probe = TF.probe_hub
    monkeypatch.setattr(TF, "probe_hub", lambda url: probes.append(url) or real_probe(url))
    return probes


def test_a_cached_name_and_an_unreachable_hub_is_loaded_offline(gpt2, hf_cache, closed_port,
                                                                monkeypatch):
    endpoint = f"http://127.0.0.1:{closed_port}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    hub_cache_entry(hf_cache, "gpt2", gpt2_hub_files(gpt2))
    probes = counted_probes(monkeypatch)
    args = hf_args("gpt2")
    check_tokenizer_files(args)  # cached: the check asks nothing
    assert probes == []
    line = TF.cached_hub_name_offline(args)
    assert line.startswith(f"tokenizer: gpt2 from the local Hugging Face cache ({hf_cache}); "
                           f"the hub ({endpoint}) does not answer (")
    assert line.endswith("), so it is not asked") and "Connection refused" in line
    assert TF.cached_hub_name_offline(args) == line
    assert probes == [endpoint]  # once a process


def test_a_cached_name_and_offline_variable_is_loaded_offline_unasked(gpt2, hf_cache,
                                                                      silent_hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", silent_hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_cache_entry(hf_cache, "openai-community/gpt2", gpt2_hub_files(gpt2))
    assert TF.cached_hub_name_offline(hf_args("openai-community/gpt2")) == (
        f"tokenizer: openai-community/gpt2 from the local Hugging Face cache ({hf_cache}); "
        "HF_HUB_OFFLINE=1 keeps the hub from being asked")
    time.sleep(0.2)
    assert silent_hub.accepted == []


def test_a_cached_name_and_a_hub_that_answers_loads_as_before(gpt2, hf_cache, answering_hub,
                                                              monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", answering_hub.url)
    hub_cache_entry(hf_cache, "gpt2", gpt2_hub_files(gpt2))
    for _ in range(2):
        assert TF.cached_hub_name_offline(hf_args("gpt2")) is None
    assert answering_hub.requests == ["/"]


def test_only_a_cached_hub_name_is_loaded_offline(gpt2, hf_cache, closed_port, tmp_path,
                                                  monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    probes = counted_probes(monkeypatch)
    folder = tmp_path / "folder"
    folder.mkdir()
    for args in (hf_args("gpt2"),  # not cached: the check refuses it
                 hf_args(str(folder)),
                 tokenizer_namespace(tokenizer_type="GPT2BPETokenizer",
                                     vocab_file=gpt2.vocab_file, merge_file=gpt2.merge_file),
                 tokenizer_namespace(tokenizer_type="NullTokenizer", vocab_size=512)):
        assert TF.cached_hub_name_offline(args) is None
    assert probes == []


@pytest.mark.parametrize("before", [None, "0"])
def test_hub_offline_is_scoped_and_restored(hf_cache, silent_hub, tmp_path, monkeypatch,
                                            before):
    """Inside, huggingface_hub refuses to ask the hub (it looks in the cache only); after,
    its setting and the variable are as they were, also when the load raised."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if before is not None:
        monkeypatch.setenv("HF_HUB_OFFLINE", before)
    saved = constants.HF_HUB_OFFLINE
    with pytest.raises(LocalEntryNotFoundError):
        with TF.hub_offline():
            assert constants.is_offline_mode() is True and os.environ["HF_HUB_OFFLINE"] == "1"
            hf_hub_download("gpt2", "config.json", cache_dir=str(tmp_path / "empty"),
                            endpoint=silent_hub.url)
    assert constants.HF_HUB_OFFLINE is saved
    assert os.environ.get("HF_HUB_OFFLINE") == before
    time.sleep(0.2)
    assert silent_hub.accepted == []


LOAD_TWICE = """
import json, os, time
from huggingface_hub import constants
from megagpt.data import tokenizer_files as TF
from megagpt.data.tokenizers import build_tokenizer, tokenizer_namespace
TF.HUB_PROBE_TIMEOUT_S = 0.5
probes = []
real_probe = TF.probe_hub
TF.probe_hub = lambda url: probes.append(url) or real_probe(url)
args = tokenizer_namespace(tokenizer_type='HuggingFaceTokenizer', tokenizer_model=NAME)
TF.check_tokenizer_files(args)
offline_before = constants.HF_HUB_OFFLINE
seconds, ids = [], []
for _ in range(2):
    start = time.monotonic()
    ids.append(build_tokenizer(args).tokenize('Hello world'))
    seconds.append(time.monotonic() - start)
print(json.dumps({'ids': ids, 'seconds': seconds, 'probes': probes,
                  'offline': [offline_before, constants.HF_HUB_OFFLINE,
                              os.environ.get('HF_HUB_OFFLINE')]}))
"""


@pytest.mark.slow
def test_a_cached_name_loads_at_once_when_the_hub_does_not_answer(gpt2, tmp_path, silent_hub):
    """No HF_HUB_OFFLINE, a hub that accepts connections and never answers: the one probe
    is all it is asked (huggingface_hub online would wait on it for minutes), the tokenizer
    loads from the cache with GPT-2's ids, one line says so, and huggingface_hub is online
    again afterwards."""
    cache = tmp_path / "hub"
    hub_cache_entry(cache, "openai-community/gpt2", gpt2_hub_files(gpt2))
    env = {k: v for k, v in os.environ.items() if k not in HUB_VARIABLES}
    env.update(HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "home"),
               HF_ENDPOINT=silent_hub.url)
    code = LOAD_TWICE.replace("NAME", repr("openai-community/gpt2"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["ids"] == [[15496, 995]] * 2
    assert result["probes"] == [silent_hub.url]
    assert result["offline"] == [False, False, None]
    assert max(result["seconds"]) < WELL_UNDER_THE_RETRIES_S
    said = [line for line in r.stdout.splitlines() if line.startswith("[megagpt] tokenizer:")]
    assert len(said) == 2, r.stdout[-3000:]
    for line in said:  # the probe's socket timeout or the wait on it, whichever ends first
        assert re.fullmatch(
            re.escape(f"[megagpt] tokenizer: openai-community/gpt2 from the local Hugging Face "
                      f"cache ({cache}); the hub ({silent_hub.url}) does not answer (")
            + r"(no answer within 0\.5 s|timed out)"
            + re.escape("), so it is not asked"), line), line
    assert len(silent_hub.accepted) == 1  # the probe


@pytest.mark.slow
def test_a_cached_name_without_its_config_fails_in_one_line_at_once(gpt2, tmp_path,
                                                                    closed_port):
    """transformers reads config.json too: a cache with the tokenizer's files only does not
    load offline; the load's error is one line, at once."""
    cache = tmp_path / "hub"
    files = gpt2_hub_files(gpt2)
    del files["config.json"]
    hub_cache_entry(cache, "gpt2", files)
    code = ("import time\n"
            "from megagpt.data.tokenizer_files import check_tokenizer_files, load_error\n"
            "from megagpt.data.tokenizers import build_tokenizer, tokenizer_namespace\n"
            "a = tokenizer_namespace(tokenizer_type='HuggingFaceTokenizer',"
            " tokenizer_model='gpt2')\n"
            "check_tokenizer_files(a)\n"
            "start = time.monotonic()\n"
            "try:\n"
            "    build_tokenizer(a)\n"
            "except Exception as exc:\n"
            "    print(time.monotonic() - start)\n"
            "    print(load_error(exc, a))\n")
    env = {k: v for k, v in os.environ.items() if k not in HUB_VARIABLES}
    env.update(HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "home"),
               HF_ENDPOINT=f"http://127.0.0.1:{closed_port}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    seconds, message = r.stdout.strip().splitlines()[-2:]
    assert float(seconds) < WELL_UNDER_THE_RETRIES_S
    assert message.startswith("cannot load the tokenizer (--tokenizer-type HuggingFaceTokenizer "
                              "--tokenizer-model gpt2): ")
    assert "[megagpt] tokenizer: gpt2 from the local Hugging Face cache" in r.stdout
