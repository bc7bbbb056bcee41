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
