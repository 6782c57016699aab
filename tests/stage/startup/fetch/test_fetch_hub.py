"""Model fetch from the Hugging Face Hub: a hand-built huggingface_hub cache offline,
and a fake hub online."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.mesh.errors import InitFailed
from services.stage.startup.fetch import fetch_model
from tests.helpers.fake_hub import FakeHub
from tests.stage.startup.fetch.fetch_recording import RecordingHook, fetch

REPO_ROOT = Path(__file__).resolve().parents[4]
COMMIT = "0123456789abcdef" * 2 + "01234567"


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME. huggingface_hub reads its environment once, at import; the
    fetch reads it at call time, which is what these tests rely on and check."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return home


def build_hub_cache(home: Path, repo: str, files: dict[str, bytes]) -> Path:
    """The layout huggingface_hub writes: blobs, a snapshot of links to them, refs/main."""
    storage = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / COMMIT
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_hf_offline_uses_the_local_cache(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(4096)}
    snapshot = build_hub_cache(hf_home, "org/tiny", files)
    for source in ("hf://org/tiny", f"hf://org/tiny@{COMMIT}"):
        result, hook = fetch(source, hf_home / "unused")
        assert (result.path, result.cache_hit, result.nbytes) == (snapshot, True, 8 + 4096)
        assert hook.events[0][:2] == ("start", source)
    assert not (hf_home / "unused").exists()


def test_hf_offline_and_not_cached_fails_clearly(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # An endpoint that would answer proves offline mode makes no request at all.
    with FakeHub("org/absent", {"config.json": b"{}"}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(InitFailed, match=r"not in the local cache .* HF_HUB_OFFLINE is set"):
            fetch_model("hf://org/absent@v1", hf_home, RecordingHook())
    assert hub.downloads == []


# huggingface_hub freezes HF_HUB_OFFLINE at import and an earlier test imported it
# offline, so the online case runs in a fresh interpreter, as a stage process would.
ONLINE_FETCH = """
import json
from pathlib import Path
from services.stage.startup.fetch import fetch_model

class Hook:
    progress_events = []
    def start(self, source, bytes_total): pass
    def progress(self, done, total): self.progress_events.append((done, total))
    def done(self, result, duration_s): pass

out = []
for _ in range(2):
    hook = Hook()
    r = fetch_model("hf://org/name", Path("unused"), hook, progress_interval_s=0.0)
    out.append([str(r.path), r.nbytes, r.cache_hit, hook.progress_events[-1:]])
    Hook.progress_events = []
print(json.dumps(out))
"""


def test_hf_online_download_reports_bytes_then_hits_the_cache(hf_home: Path) -> None:
    files = {"config.json": b"{}", "model.bin": os.urandom(300_000)}
    with FakeHub("org/name", files) as hub:
        env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint}
        proc = subprocess.run(
            [sys.executable, "-c", ONLINE_FETCH],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    first, second = json.loads(proc.stdout.splitlines()[-1])
    snapshot = hf_home / "hub" / "models--org--name" / "snapshots" / hub.commit
    assert first == [str(snapshot), 300_002, False, [[300_002, 300_002]]]
    assert second == [str(snapshot), 300_002, True, []]
    assert sorted(hub.downloads) == ["config.json", "model.bin"]  # once each
    assert (snapshot / "model.bin").read_bytes() == files["model.bin"]
