"""The Hugging Face hub for the data scripts: a quick reachability check, and hub failures as one-paragraph errors.

huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE and friends when it is imported, so set them before running.
"""
import httpx2  # huggingface_hub's HTTP client: its transport errors mean the hub was not reached at all
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                    RemoteEntryNotFoundError, RepositoryNotFoundError)

from data.common import UserError

PROBE_TIMEOUT_S = 10
# What a failed request can raise: httpx2's errors, and OSErrors (hub HTTP errors, offline mode, size checks, disk).
HUB_ERRORS = (httpx2.HTTPError, OSError)


def _text(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())  # the hub's messages span lines; keep one paragraph


def hub_error(error: BaseException, repo_id: str, filename: str) -> UserError:
    """A UserError saying what went wrong reaching `filename` of the dataset `repo_id`, and what to do."""
    where = f"{filename} of the dataset {repo_id} at {constants.ENDPOINT}"
    if isinstance(error, OfflineModeIsEnabled):
        return UserError(f"cannot download {where}: HF_HUB_OFFLINE is set; unset it to download")
    if isinstance(error, (httpx2.TransportError, LocalEntryNotFoundError)):
        return UserError(
            f"could not reach the Hugging Face hub to download {where} ({_text(error)}). Check the internet "
            "connection, the proxy settings (HTTPS_PROXY) or HF_ENDPOINT, then run the command again: files already "
            "downloaded are kept. Without internet, copy the shards in by other means and verify them with "
            "`python data/check.py`, or train on the embedded Shakespeare data with "
            "`python train_gpt.py --preset cpu`.")
    if isinstance(error, RepositoryNotFoundError):  # also gated or private repos
        return UserError(f"the hub has no dataset {repo_id} that this client may read ({_text(error)}); check the "
                         "name, or log in with `hf auth login` if it is gated")
    if isinstance(error, RemoteEntryNotFoundError):
        return UserError(f"the dataset {repo_id} at {constants.ENDPOINT} has no file {filename}")
    if isinstance(error, HfHubHTTPError):
        return UserError(f"the hub refused {where} ({_text(error)}); try again later")
    return UserError(f"downloading {where} failed ({_text(error)}); nothing was kept under its final name, "
                     "so running the command again starts that file afresh")


def probe(repo_id: str, filename: str) -> None:
    """One HEAD request without retries: fail within seconds when the hub is unreachable (hf_hub_download alone
    retries with back-off for about half a minute before giving up)."""
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename, repo_type="dataset"), timeout=PROBE_TIMEOUT_S)
    except HUB_ERRORS as e:
        raise hub_error(e, repo_id, filename) from None
