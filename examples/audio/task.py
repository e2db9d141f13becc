"""Audio classification with mlxdist: WAV -> log-mel spectrogram -> small CNN -> label, in the
shape of a speech-emotion recogniser (RAVDESS, CREMA-D), trained with the torch engine on
MPS, CUDA or the CPU, on one machine or across Macs.

    python task.py make-data data/chords    # 4 labelled classes of synthetic chord clips
    python -m mlxdist.train --engine torch --device auto --config configs/m4pro-16gb.yaml
    python task.py eval runs/m4pro-16gb      # held-out accuracy of the latest checkpoint

Data: `root/<label>/*.wav`, one folder per label. Mels are computed once with numpy and
cached next to the data, so every later run (and every rank) starts in a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F
from torch import nn

import mlxdist

# The synthetic set: mode and tempo stand in for valence and arousal.
MOODS = {"happy": ("major", "fast"), "calm": ("major", "slow"), "sad": ("minor", "slow"), "angry": ("minor", "fast")}
CHORDS = {"major": (0, 4, 7), "minor": (0, 3, 7)}  # semitones above the root
BEATS_PER_S = {"slow": (1.5, 2.5), "fast": (5.0, 7.0)}


# ---------------------------------------------------------------- synthetic data
def chord_clip(mode: str, tempo: str, seconds: float, sr: int, rng: np.random.Generator) -> np.ndarray:
    """A chord struck on every beat: a random root, so the model must hear the intervals
    (major third or minor third) rather than an absolute pitch."""
    t = np.arange(int(seconds * sr)) / sr
    root = 440.0 * 2 ** ((rng.integers(52, 65) - 69) / 12)  # E3..E4
    beat = 1.0 / rng.uniform(*BEATS_PER_S[tempo])
    since_beat = (t + rng.uniform(0, beat)) % beat
    envelope = np.exp(-4.0 * since_beat / beat) * np.minimum(since_beat * 200, 1)  # 5 ms attack
    tone = np.zeros_like(t)
    for semitones in CHORDS[mode]:
        f = root * 2 ** (semitones / 12)
        for h in range(1, 7):  # six harmonics falling as 1/h: a reedy timbre
            tone += np.sin(2 * np.pi * f * h * t + rng.uniform(0, 2 * np.pi)) / h
    wave = tone * envelope + rng.normal(0, rng.uniform(0.02, 0.2), len(t))
    return (wave / np.abs(wave).max() * rng.uniform(0.3, 0.9)).astype(np.float32)


def make_data(root: str | Path, per_label: int = 100, seconds: float = 1.5, sr: int = 16000) -> Path:
    """Write `per_label` clips per mood as 16-bit WAV, each from its own seed, so every host
    makes the same set. Written to a temporary folder and renamed, so ranks that start
    together on one host never see half a data set (the first rename wins; the others are
    discarded)."""
    root = Path(root)
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    for label_id, (label, (mode, tempo)) in enumerate(MOODS.items()):
        (tmp / label).mkdir(parents=True)
        for i in range(per_label):
            rng = np.random.default_rng([label_id, i])
            sf.write(tmp / label / f"{label}_{i:04d}.wav", chord_clip(mode, tempo, seconds, sr, rng), sr,
                     subtype="PCM_16")
    try:
        tmp.rename(root)
    except OSError:  # another rank got there first
        for f in sorted(tmp.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        tmp.rmdir()
    return root


# ---------------------------------------------------------------- features
def mel_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """Triangular filters evenly spaced on the mel scale (HTK formula), shape (n_mels, n_fft//2+1)."""
    mel = np.linspace(*2595 * np.log10(1 + np.array([fmin, fmax]) / 700), n_mels + 2)
    edges = 700 * (10 ** (mel / 2595) - 1)
    freqs = np.fft.rfftfreq(n_fft, 1 / sr)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    return np.maximum(0, np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)))


def log_mel(wave: np.ndarray, sr: int, n_fft: int, hop: int, n_mels: int) -> np.ndarray:
    """(n_mels, frames) log-mel power of a mono clip, standardised per clip so loudness and
    microphone gain do not matter."""
    frames = np.lib.stride_tricks.sliding_window_view(wave, n_fft)[::hop] * np.hanning(n_fft)
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    # einsum, not `@`: numpy's own loop rather than the BLAS, whose rounding differs between
    # libraries, and every rank must compute the same bytes.
    mels = np.log(np.einsum("tf,mf->mt", power, mel_filterbank(sr, n_fft, n_mels, 30.0, sr / 2)) + 1e-6)
    return (mels - mels.mean()) / (mels.std() + 1e-6)


def read_clip(path: Path, sr: int, seconds: float) -> np.ndarray:
    """Mono, resampled to `sr` (by FFT: RAVDESS is 48 kHz), cut or zero-padded to `seconds`."""
    wave, file_sr = sf.read(path, dtype="float64", always_2d=True)
    wave = wave.mean(axis=1)
    if file_sr != sr:
        n = round(len(wave) * sr / file_sr)
        wave = np.fft.irfft(np.fft.rfft(wave)[: n // 2 + 1], n) * n / len(wave)
    n = int(seconds * sr)
    return np.pad(wave, (0, max(0, n - len(wave))))[:n]


def load_mels(root: Path, settings: dict) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    """(mels, label ids, label names, files), computed once and cached in `root` as an .npz
    keyed by the file list and the settings: change either and it is recomputed. Copy the
    cache to every host along with the WAVs: mlxdist compares a few samples' bytes across
    ranks, and two machines' numpy builds may round the last bit differently."""
    labels = sorted(d.name for d in root.iterdir() if d.is_dir())
    files = [f"{label}/{f.name}" for label in labels for f in sorted((root / label).glob("*.wav"))]
    if not files:
        raise FileNotFoundError(f"{root}: no <label>/*.wav files (the synthetic set is made only where "
                                "the folder does not exist)")
    listing = [(f, (root / f).stat().st_size) for f in files]
    key = hashlib.sha256(json.dumps([listing, settings]).encode()).hexdigest()[:12]
    cache = root / f"mels-{key}.npz"
    if cache.exists():
        with np.load(cache) as z:
            return z["x"], z["y"], labels, files
    sr, seconds = settings["sample_rate"], settings["seconds"]
    x = np.stack([log_mel(read_clip(root / f, sr, seconds), sr, settings["n_fft"], settings["hop"],
                          settings["n_mels"]) for f in files])[:, None].astype(np.float32)  # (N, 1, mels, frames)
    y = np.array([labels.index(f.split("/")[0]) for f in files], np.int64)
    tmp = cache.with_name(f"{cache.stem}.tmp-{os.getpid()}.npz")  # atomic: ranks may write at once
    np.savez(tmp, x=x, y=y)
    tmp.replace(cache)
    return x, y, labels, files


class Clips:
    """A labelled set of mel spectrograms; mlxdist needs only len() and [i]."""

    def __init__(self, x: np.ndarray, y: np.ndarray, labels: list[str]):
        self.x, self.y, self.labels = x, y, labels

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"mel": self.x[i], "label": self.y[i]}


# ---------------------------------------------------------------- model and loss
class MaxAndMean(nn.Module):
    """Each channel's strongest and average response over time and frequency: "is this
    interval or onset pattern anywhere in the clip", whatever the root note or clip length."""

    def forward(self, x):
        return torch.cat([x.amax(dim=(2, 3)), x.mean(dim=(2, 3))], dim=1)


def cnn(n_classes: int, width: int = 16) -> nn.Module:
    """Four 3x3 conv blocks, pooled to one vector per clip. No normalisation layer: BatchNorm
    mixes the samples of a batch, so a rank's 3 samples and another's 5 would not train like
    8 in one process (`python -m mlxdist.check_task` says so); GroupNorm would be exact, but
    learnt this set more slowly in our tries."""

    def block(c_in: int, c_out: int, pool: bool) -> list[nn.Module]:
        layers = [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
        return layers + [nn.MaxPool2d(2)] if pool else layers

    w = width
    return nn.Sequential(*block(1, w, True), *block(w, 2 * w, True), *block(2 * w, 4 * w, True),
                         *block(4 * w, 4 * w, False), MaxAndMean(), nn.Linear(8 * w, n_classes))


def loss(model, batch):  # the SUM over the batch's clips: mlxdist divides by the global count
    return F.cross_entropy(model(batch["mel"]), batch["label"], reduction="sum")


def make_task(root: str = "data/chords", seconds: float = 1.5, sample_rate: int = 16000, n_fft: int = 1024,
              hop: int = 256, n_mels: int = 64, width: int = 16, holdout_every: int = 5,
              per_label: int = 100) -> mlxdist.Task:
    """The task for `task.factory: task:make_task`. Every `holdout_every`-th clip of each label
    (in file-name order) is held out for evaluation. A missing `root` is filled with the
    synthetic set (`per_label` clips per mood), so the example runs anywhere."""
    root = Path(root)
    if not root.exists():
        make_data(root, per_label, seconds, sample_rate)
    settings = {"sample_rate": sample_rate, "seconds": seconds, "n_fft": n_fft, "hop": hop, "n_mels": n_mels}
    x, y, labels, _ = load_mels(root, settings)
    rank_in_label = np.concatenate([np.arange(np.sum(y == c)) for c in range(len(labels))])  # files are label-sorted
    held = rank_in_label % holdout_every == holdout_every - 1
    return mlxdist.Task(build=lambda ctx: cnn(len(labels), width), loss=loss, dataset=Clips(x[~held], y[~held], labels),
                        eval_dataset=Clips(x[held], y[held], labels), unit="clips",
                        data_summary=f"{len(y) - held.sum()} train / {held.sum()} held-out clips of "
                                     f"{len(labels)} labels ({', '.join(labels)}) from {root}, {x.shape[2]} mels x {x.shape[3]} frames")


# ---------------------------------------------------------------- held-out accuracy
def evaluate(run_dir: str) -> None:
    """Accuracy of the run's latest checkpoint on the held-out clips, rebuilt from the
    task.args it recorded (run this from the directory the run was started in)."""
    from mlxdist.state.checkpoint import load_latest

    loaded = load_latest(Path(run_dir) / "checkpoints")
    if loaded is None:
        sys.exit(f"no checkpoint in {run_dir}/checkpoints")
    args = loaded.state["config"]["task"]["args"]
    task = make_task(**args)
    model = task.build(None)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in loaded.weights.items()})
    model.eval()
    x, y, labels = task.eval_dataset.x, task.eval_dataset.y, task.eval_dataset.labels
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(1).numpy()
    per_label = ", ".join(f"{name} {np.mean(pred[y == c] == c):.0%}" for c, name in enumerate(labels))
    print(f"{loaded.path.name}: held-out accuracy {np.mean(pred == y):.1%} on {len(y)} clips ({per_label})")


if __name__ == "__main__":
    usage = "usage: python task.py make-data DIR [CLIPS_PER_LABEL] | python task.py eval RUN_DIR"
    if len(sys.argv) >= 3 and sys.argv[1] == "make-data":
        if Path(sys.argv[2]).exists():
            sys.exit(f"{sys.argv[2]} exists; remove it first to make it again")
        print(make_data(sys.argv[2], *map(int, sys.argv[3:4])))
    elif len(sys.argv) == 3 and sys.argv[1] == "eval":
        evaluate(sys.argv[2])
    else:
        sys.exit(usage)
