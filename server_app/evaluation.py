"""A run's models scored where a consortium needs them scored before anyone uses them: at every hospital at
the end of the run (cross-site evaluation), and on any labelled folder the run never saw (``fedmed evaluate``).

Cross-site: the strategy asks every hospital to score the final global model and, for methods that
personalise, its own model on its validation data (``HospitalStrategy.cross_site_evaluation``); here the
scores become ``cross_site.json``, ``cross_site.md`` (hospitals x models) and ``plots/cross_site.png``.

External: :func:`evaluate_run` loads a run's checkpoint (latest, ``round``, or with ``best`` the best round's model
that ``select-by`` kept in ``checkpoints/best.npz``), the folder in any format the
task reads (HAM10000 layout, npz, image/mask folders, BraTS case folders), and scores the global model, a
FedProto hospital's own model, or an exported INT8 model, overall and per source.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from common.config import ConfigError, JobConfig
from common.data.containers import DataError

from .results import HEADLINE, SKIP_IN_TABLES, _fmt, _save, _write


def score_table(rows: dict[str, dict[str, float]], label: str) -> str:
    """Markdown: one row per entry of ``rows`` (a model, a hospital), one column per metric seen."""
    metrics: list[str] = []
    for scores in rows.values():
        metrics += [k for k in scores if k not in metrics and k not in SKIP_IN_TABLES]
    lines = ["| " + " | ".join([label, *metrics]) + " |", "|" + "---|" + "---:|" * len(metrics)]
    for name, scores in rows.items():
        lines.append("| " + " | ".join([name, *[_fmt(scores[m]) if m in scores else "" for m in metrics]]) + " |")
    return "\n".join(lines)


# --- cross-site evaluation at the end of a run ---------------------------------------------------------
def render_cross_site(record: dict[str, Any], headline: str) -> str:
    """The hospitals x models table of the headline metric, then every metric per model."""
    scores = record["scores"]
    models = sorted({model for by_model in scores.values() for model in by_model})
    lines = [f"## Cross-site evaluation after round {record['after-round']}", "",
             f"{headline} of each final model on each hospital's own validation data.", "",
             score_table({h: {m: by_model[m].get(headline, math.nan) for m in models if m in by_model}
                          for h, by_model in sorted(scores.items())}, "hospital")]
    for model in models:
        lines += ["", f"### {model} model", "",
                  score_table({h: by_model[model] for h, by_model in sorted(scores.items()) if model in by_model},
                              "hospital")]
    if record["failed"]:
        lines += ["", "Could not score: " + "; ".join(f"{h} ({why})" for h, why in sorted(record["failed"].items()))]
    if record["missing"]:
        lines += ["", "No answer: " + ", ".join(record["missing"])]
    return "\n".join(lines) + "\n"


def plot_cross_site(record: dict[str, Any], headline: str, path: Path) -> Path | None:
    """A heatmap of the headline metric, hospitals x models (blank where a hospital did not answer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    hospitals = sorted(set(record["scores"]) | set(record["failed"]) | set(record["missing"]))
    models = sorted({model for by_model in record["scores"].values() for model in by_model})
    if not hospitals or not models:
        return None
    values = np.array([[record["scores"].get(h, {}).get(m, {}).get(headline, np.nan) for m in models]
                       for h in hospitals], dtype=float)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(models), 1.0 + 0.4 * len(hospitals)))
    image = ax.imshow(values, cmap="viridis", aspect="auto", vmin=np.nanmin(values) if np.isfinite(values).any() else 0)
    ax.set_xticks(range(len(models)), [f"{m} model" for m in models])
    ax.set_yticks(range(len(hospitals)), hospitals)
    for i in range(len(hospitals)):
        for j in range(len(models)):
            text = "" if math.isnan(values[i, j]) else f"{values[i, j]:.3f}"
            absent = "failed" if hospitals[i] in record["failed"] else "no answer"
            ax.text(j, i, text or absent, ha="center", va="center", color="white" if text else "grey")
    fig.colorbar(image, ax=ax, label=headline)
    ax.set_title(f"cross-site {headline} after round {record['after-round']}")
    fig.tight_layout()
    return _save(fig, path)


def write_cross_site(run_dir: Path, record: dict[str, Any], task: str) -> str:
    """``cross_site.json``, ``cross_site.md`` and ``plots/cross_site.png`` in the run folder; returns the markdown."""
    headline = HEADLINE[task]
    text = render_cross_site(record, headline)
    _write(Path(run_dir) / "cross_site.json", json.dumps(record, indent=1) + "\n")
    _write(Path(run_dir) / "cross_site.md", text)
    plot_cross_site(record, headline, Path(run_dir) / "plots" / "cross_site.png")
    return text


# --- a run's model on a labelled folder ----------------------------------------------------------------
def folder_format(task: str, folder: Path) -> str:
    """The data set format of a folder, from its layout (``dataset`` of the run config)."""
    if task == "brain-tumour-segmentation":
        return "brats"
    if task == "polyp-segmentation":
        return "image-mask"
    if folder.is_file() and folder.suffix == ".npz" or folder.is_dir() and any(folder.glob("*.npz")):
        return "npz"
    if folder.is_dir() and any(folder.glob("*metadata*.csv")):
        return "ham10000"
    raise DataError(f"{folder}: neither a HAM10000 folder (a *metadata*.csv) nor npz data; pass --dataset")


def evaluate_run(run: Path, data: Path, *, round_number: int | None = None, int8_model: Path | None = None,
                 modalities: str = "", hospital: str = "", dataset: str = "", best: bool = False,
                 app_dir: Path | None = None) -> dict[str, Any]:
    """Scores of a run's model on the labelled ``data``: ``{"model", "data", "checkpoint", "overall", "sources"}``
    (and ``"best"``: round, metric and value, for the best round's model). The run's own network, model arguments,
    loader and its arguments are the run's (its checkpoint's config): a loader of its own reads ``data`` as the
    server's test set, and its modules are imported from where the run took them, or ``app_dir``
    (:mod:`common.engine.run_imports`)."""
    from common.engine.run_imports import run_modules_importable
    from common.methods.base import unpack_json

    from .checkpoint import checkpoint_dir, find_best, load_checkpoint, read_best

    if best and round_number:
        raise ConfigError("--best and --round: give one (--best is the round select-by chose)")
    if best and int8_model:
        raise ConfigError("--best and --model: an INT8 model is the round it was exported from; export the best "
                          "round's with `fedmed export-int8 --run RUN --best`")
    source = checkpoint_dir(run) / f"round-{round_number:05d}.npz" if round_number else Path(run)
    if best:
        source = find_best(run)
    if round_number and not source.is_file():
        raise ConfigError(f"--round {round_number}: {source} does not exist (checkpoints are kept for the last "
                          "rounds only: keep-checkpoints)")
    state = load_checkpoint(source)
    cfg = JobConfig.model_validate(unpack_json(state["run/config"]))
    data = Path(data)
    if not data.exists():
        raise ConfigError(f"--data: {data} does not exist")
    with run_modules_importable(cfg, state, app_dir):
        result = score_checkpoint(run, source, state, cfg, data, int8_model, modalities, hospital, dataset)
    if best:
        chosen = read_best(source)
        result["best"] = {"round": chosen["round"], "metric": chosen["metric"], "value": chosen["value"]}
        result["model"] = f"{result['model']} of the best round"
    return result


def score_checkpoint(run: Path, source: Path, state: dict[str, Any], cfg: JobConfig, data: Path,
                     int8_model: Path | None, modalities: str, hospital: str, dataset: str) -> dict[str, Any]:
    """:func:`evaluate_run`'s scores, the run's own modules importable."""
    from common.data.brain_sources import load_folder_cases
    from common.data.brats import parse_modalities
    from common.data.loaders import is_custom
    from common.methods.base import unpack_json
    from common.methods.registry import server_class
    from common.tasks import get_task, task_class

    own = cfg.dataset if is_custom(cfg.dataset) else ""  # the run's own loader reads the folder, as it read its data
    eval_cfg = cfg.model_copy(update={"dataset": dataset or own or folder_format(cfg.task, data),
                                      "test_dir": str(data), "data_dir": ""})
    task_type = task_class(cfg.task)
    if modalities:  # only those sequences are read: the folder need not hold the others
        if cfg.task != "brain-tumour-segmentation":
            raise ConfigError("--modalities is for the brain tumour task")
        cases = load_folder_cases(eval_cfg, data, parse_modalities(modalities, "--modalities"))
    else:
        cases = task_type.load_test(eval_cfg)
    spec = task_type.describe(cases)
    run_spec = unpack_json(state["run/model-spec"]) if "run/model-spec" in state else {}
    for key in ("class-names", "in-channels", "num-classes"):
        if key in run_spec and key in spec and str(run_spec[key]) != str(spec[key]):
            raise DataError(f"{data}: its {key} is {spec[key]!r}, but {run} was trained with {run_spec[key]!r}")
    task = get_task(eval_cfg, {**spec, **run_spec})
    if int8_model:
        from common.quantization.int8 import load_deployment

        if cfg.task != "polyp-segmentation":
            raise ConfigError("--model: INT8 models are exported for the polyp task only")
        model, meta = load_deployment(int8_model)
        if int(meta["image-size"]) != cfg.image_size:
            raise ConfigError(f"--model: {int8_model} takes {meta['image-size']} px images, the run "
                              f"{cfg.image_size} px")
        name = f"INT8 {Path(int8_model).name}"
    else:
        method = server_class(cfg.strategy)(eval_cfg, task)
        method.initialize()
        method.load_state_dict({k.removeprefix("method/"): v for k, v in state.items() if k.startswith("method/")})
        model = method.evaluation_model(hospital or None)
        name = f"{hospital}'s own model" if hospital else "global model"
    scores = task.evaluate(model, cases)
    overall = {k: v for k, v in scores.items() if "/" not in k}
    sources: dict[str, dict[str, float]] = {}
    for key, value in scores.items():
        if "/" in key:
            metric, _, where = key.partition("/")
            sources.setdefault(where, {})[metric] = value
    rounds = len(unpack_json(state["run/history"]))
    return {"run": str(run), "model": name, "data": str(data), "dataset": eval_cfg.dataset, "after-round": rounds,
            "overall": overall, "sources": sources}


def render_evaluation(result: dict[str, Any]) -> str:
    lines = [f"## {result['model']} of {result['run']} (after round {result['after-round']})", ""]
    if result.get("best"):
        chosen = result["best"]
        lines += [f"chosen by {chosen['metric']} = {_fmt(chosen['value'])}, the best round of the run", ""]
    lines += [f"on `{result['data']}` ({result['dataset']})", "",
              score_table({"all": result["overall"], **result["sources"]}, "data")]
    return "\n".join(lines) + "\n"


def write_evaluation(result: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """``<out>.json`` and ``<out>.md``."""
    out = Path(out)
    _write(out.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    _write(out.with_suffix(".md"), render_evaluation(result))
    return out.with_suffix(".json"), out.with_suffix(".md")
