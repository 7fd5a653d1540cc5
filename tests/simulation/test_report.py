"""What a reader of ``gpush simulate`` sees: the summary says which way each measure is
good and each run's held reasons; runs are named alike everywhere; every plot has a
title, labelled axes, y from 0, a caption, one colour per run, nothing hidden; a long
run shows progress on stderr."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from matplotlib.colors import to_hex

from broker.simulation.fleet import load_fleet_file
from broker.simulation.plots import CAPTIONS, figures, run_colours, same_steps, time_weighted_bins
from broker.simulation.progress import Progress, Silent
from broker.simulation.replay import replay
from broker.simulation.report import run_simulation
from broker.simulation.report_text import summary_lines
from broker.simulation.workload import load_workload

ROOT = Path(__file__).resolve().parents[2]
DEMO_FLEET = ROOT / "examples" / "fleet.yaml"
DEMO_WORKLOAD = ROOT / "examples" / "workload.yaml"
DEFAULT_POLICY = ROOT / "policies" / "default.yaml"
ALL_KUBERNETES = ROOT / "policies" / "all-kubernetes.yaml"

NODES_CSV = """sn,cpu_milli,memory_mib,gpu,model
openb-node-0001,96000,393216,8,G2
openb-node-0002,32000,131072,4,V100M16
"""
PODS_CSV = """\
name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
openb-pod-0000,12000,16384,1,1000,,LS,Running,0,1000,0
openb-pod-0001,6000,12288,1,460,,LS,Running,10,500,12
openb-pod-0002,4000,8192,1,810,,BE,Failed,20,300,20
openb-pod-0004,64000,262144,8,1000,,LS,Pending,40,700,
openb-pod-0005,4000,8192,1,230,,Burstable,Succeeded,50,80,51
"""


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    (tmp_path / "openb_node_list_gpu_node.csv").write_text(NODES_CSV)
    (tmp_path / "openb_pod_list_default.csv").write_text(PODS_CSV)
    return tmp_path


def demo(tmp_path: Path, compare: Path | None = None, **options) -> dict:
    return run_simulation(
        str(DEMO_FLEET),
        str(DEMO_WORKLOAD),
        None,
        str(DEFAULT_POLICY),
        None if compare is None else str(compare),
        str(tmp_path / "r"),
        **options,
    )


def demo_runs(compare_with_itself: bool = False):
    fleet, policy_text = load_fleet_file(str(DEMO_FLEET)), DEFAULT_POLICY.read_text()
    from broker.routing.policy import load_policy

    policy = load_policy(policy_text, "default.yaml")
    loaded = load_workload(str(DEMO_WORKLOAD))
    primary = replay(fleet, policy, loaded.arrivals, label="gpush (default.yaml)", tenants=loaded.tenants)
    if compare_with_itself:
        other = replay(fleet, policy, loaded.arrivals, label="default.yaml", tenants=loaded.tenants)
    else:
        need = {j.job_id: j.gpu_equivalents for j in primary.jobs if j.start is not None}
        other = replay(
            fleet,
            policy,
            loaded.arrivals,
            whole_gpus=True,
            label="whole GPUs",
            demand_of=need.get,
            tenants=loaded.tenants,
        )
    return primary, other


def legend_entries(fig) -> dict[str, str]:
    """Legend text (unwrapped) -> the colour of its handle, over every legend of the figure."""
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    entries = {}
    for legend in legends:
        for handle, text in zip(legend.legend_handles, legend.get_texts(), strict=True):
            label = text.get_text().replace("\n", " ")
            if hasattr(handle, "get_color") and not hasattr(handle, "get_facecolor"):
                colour = handle.get_color()
            else:
                colour = handle.get_facecolor()
            entries[label] = to_hex(colour, keep_alpha=False)
    return entries


# -- the summary ----------------------------------------------------------------------------


def test_the_summary_says_lower_allocation_for_the_same_need_is_better(tmp_path: Path) -> None:
    lines = summary_lines(demo(tmp_path, plots=False))
    text = "\n".join(lines)
    allocation = next(line for line in lines if line.strip().startswith("GPU allocation (held), mean"))
    assert allocation.rstrip().endswith("lower, for the same need")
    assert "for the same need lower is better" in " ".join(text.split())
    # The sum-up: same need, less held.
    assert "gpush (default.yaml) held 57% less GPU than whole GPUs for the same need" in " ".join(text.split())
    # Every row says which way is good.
    header = lines[1]
    assert header.rstrip().endswith("good when")


def test_the_summary_says_what_stranded_gpu_means_with_units(tmp_path: Path) -> None:
    lines = summary_lines(demo(tmp_path, plots=False))
    text = " ".join(" ".join(lines).split())
    assert any(line.strip().startswith("stranded GPU while jobs wait, mean") for line in lines)
    assert "stranded GPU: GPU-equivalents (1 = one whole GPU) free while jobs wait for capacity" in text
    assert "Lower is better." in text


def test_compare_mode_shows_each_policys_held_reason(tmp_path: Path) -> None:
    lines = summary_lines(demo(tmp_path, ALL_KUBERNETES, plots=False))
    held = [line.strip() for line in lines if line.strip().startswith("held")]
    assert any(line.startswith("held (1), gpush (default.yaml): can never fit") and "slurm-a" in line for line in held)
    assert any(line.startswith("held (1), all-kubernetes.yaml: can never fit") and "k8s-a" in line for line in held)


def test_the_same_held_reason_is_said_once_for_both_runs(tmp_path: Path) -> None:
    held = [line for line in summary_lines(demo(tmp_path, plots=False)) if line.strip().startswith("held")]
    assert len(held) == 1 and held[0].strip().startswith("held (1), both runs: can never fit")


def test_the_report_says_which_way_is_good_and_captions_the_plots(tmp_path: Path) -> None:
    demo(tmp_path)
    report = (tmp_path / "r" / "report.md").read_text()
    assert "| | gpush (default.yaml) | whole GPUs | good when |" in report
    assert "lower, for the same need |" in report
    assert "How to read it:" in report and "GPU-equivalents (1 = one whole GPU)" in report
    for name, caption in CAPTIONS.items():
        if name != "inflation.png":
            assert f"![{name}]({name})\n\n*{caption}*" in report


# -- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["fgd", "best-fit"])
def test_runs_are_named_in_the_words_of_placement_everywhere(trace_dir: Path, tmp_path: Path, placement) -> None:
    result = run_simulation(None, None, str(trace_dir), None, None, str(tmp_path / "r"), placement=placement)
    primary, comparison = result["primary"]["label"], result["comparison"]["label"]
    assert (primary, comparison) == (f"gpush ({placement})", "whole GPUs (best-fit)")
    assert (result["primary"]["placement"], result["comparison"]["placement"]) == (placement, "best-fit")
    # The inflation experiment calls its variants as the replays are called.
    assert {primary, comparison} <= set(result["inflation"]["medians"])
    assert set(result["inflation"]["medians"]) == {
        "gpush (fgd)",
        "gpush (fgd, joint)",
        "gpush (best-fit)",
        "gpush (first-fit)",
        "whole GPUs (best-fit)",
    }
    assert any("--placement" in note and "whole GPUs (best-fit)" in note for note in result["notes"])
    report = (tmp_path / "r" / "report.md").read_text()
    assert f"| | {primary} | {comparison} | good when |" in report
    detail = json.loads((tmp_path / "r" / "results.json").read_text())
    assert detail["primary"]["summary"]["label"] == primary
    lines = summary_lines(result)
    assert primary in lines[1] and comparison in lines[1]
    assert not any(old in "\n".join(lines) for old in ("gpush FGD", "best fit "))


def test_a_light_load_is_called_one(trace_dir: Path, tmp_path: Path) -> None:
    # One quarter-GPU pod on twelve GPUs: allocation says nothing of placement there.
    (trace_dir / "openb_pod_list_default.csv").write_text(
        "\n".join(PODS_CSV.splitlines()[:1] + PODS_CSV.splitlines()[-1:])
    )
    lines = summary_lines(run_simulation(None, None, str(trace_dir), None, None, str(tmp_path / "r"), plots=False))
    light = [line.strip() for line in lines if line.strip().startswith("a light load")]
    # The whole-GPU run holds one GPU of twelve for it.
    assert light == ["a light load: at most 8.3% of the GPUs were held at once, so allocation says little about"]
    assert not any("a light load" in line for line in summary_lines(demo(tmp_path, plots=False)))


# -- plots ---------------------------------------------------------------------------------------


def test_each_run_keeps_one_colour_in_every_plot(trace_dir: Path, tmp_path: Path) -> None:
    from broker.simulation import traces
    from broker.simulation.inflation import inflation_experiment
    from broker.simulation.shared import replay_shared

    trace = traces.load_openb(trace_dir)
    nodes, workload = trace.shared_nodes(), trace.workload()
    primary = replay_shared(nodes, trace.cluster, trace.policy(), workload, label="gpush (fgd)")
    whole = replay_shared(
        nodes,
        trace.cluster,
        trace.policy(),
        workload,
        placement="best-fit",
        whole_gpus=True,
        label="whole GPUs (best-fit)",
    )
    inflation = inflation_experiment(nodes, trace.tasks(), seeds=[0])
    made = figures(primary, whole, inflation)
    expected = run_colours([primary.label, whole.label, *inflation["runs"]])
    assert expected["gpush (fgd)"] != expected["whole GPUs (best-fit)"] != expected["gpush (best-fit)"]
    seen: dict[str, set[str]] = {name: set() for name in expected}
    for fig in made.values():
        for label, colour in legend_entries(fig).items():
            for name in expected:
                if label == name or label.startswith(f"{name}:") or label.startswith(f"{name} ("):
                    seen[name].add(colour)
    for name, colours in seen.items():
        assert colours == {to_hex(expected[name])}, name


def test_every_plot_has_a_title_labelled_axes_a_caption_and_y_from_zero(tmp_path: Path) -> None:
    for name, fig in figures(*demo_runs(), None).items():
        assert fig.get_supxlabel().startswith("Good:"), name
        assert fig.get_supxlabel() == CAPTIONS[name]
        for ax in fig.axes:
            if not ax.get_xlabel():  # the secondary GPU axis of allocation.png
                assert ax.get_ylabel() == "GPUs (GPU-equivalents)", name
        (ax,) = [ax for ax in fig.axes if ax.get_xlabel()]
        # One plot per figure: its title over the axes, none over the figure (it would run
        # into the legend beside them).
        assert ax.get_title(), name
        assert fig.get_suptitle() == "", name
        # The unit in brackets at the end; the shares of the fleet and of a tier are percentages.
        assert re.fullmatch(r".+ \(.+\)", ax.get_xlabel()), f"{name}: {ax.get_xlabel()!r} without its unit"
        if name in ("allocation.png", "tiers.png"):
            assert ax.get_ylabel().startswith("% of the "), name
        else:
            assert re.fullmatch(r".+ \(.+\)", ax.get_ylabel()), f"{name}: {ax.get_ylabel()!r} without its unit"
        assert ax.get_ylim()[0] == 0, name


def test_a_series_equal_to_one_drawn_before_is_dashed_over_it_and_named() -> None:
    primary, itself = demo_runs(compare_with_itself=True)
    fig = figures(primary, itself, None)["allocation.png"]
    labels = legend_entries(fig)
    # gpush holds what its jobs need: one line, named for both.
    assert "gpush (default.yaml): held = needed" in labels
    assert "default.yaml: held = needed (same as gpush (default.yaml): held = needed)" in labels
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    under = lines["gpush (default.yaml): held = needed"]
    over = lines["default.yaml: held = needed (same as gpush (default.yaml): held = needed)"]
    assert over.get_linestyle() != "-" and over.get_linewidth() < under.get_linewidth()
    assert over.get_zorder() > under.get_zorder()


def test_a_plot_says_so_when_no_job_waited(trace_dir: Path) -> None:
    from broker.simulation import traces
    from broker.simulation.shared import replay_shared

    trace = traces.load_openb(trace_dir)
    runs = [
        replay_shared(trace.shared_nodes(), trace.cluster, trace.policy(), trace.workload(), label=label)
        for label in ("gpush (fgd)", "again")
    ]
    assert all(r.summary()["waits"]["all"]["p99"] == 0 for r in runs)
    made = figures(*runs, None)
    for name, words in (("waits.png", "No job waited"), ("queue.png", "No job waited")):
        ax = made[name].axes[0]
        assert any(words in text.get_text() for text in ax.texts), name
        assert not [p for p in ax.patches if p.get_height() > 0], name  # no empty bars either
        assert ax.get_ylim()[0] == 0


def test_zero_percentiles_are_said_not_drawn() -> None:
    fig = figures(*demo_runs(), None)["waits.png"]
    labels = legend_entries(fig)
    # In the demo no kind's median job waited, in either run.
    assert "p50: 0 s for every kind in every run (not drawn)" in labels
    assert "p95" in labels and "p99" in labels
    # A percentile drawn but 0 for a kind says 0 where its bar would stand.
    assert any(text.get_text() == "0" for text in fig.axes[0].texts)


def test_values_spanning_orders_of_magnitude_get_a_log_axis_from_zero() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from broker.simulation.plots import _y_from_zero

    fig, ax = plt.subplots()
    assert _y_from_zero(ax, [1.0] * 50 + [5000.0]) == "log"
    assert ax.get_yscale() == "symlog" and ax.get_ylim()[0] == 0
    fig2, ax2 = plt.subplots()
    assert _y_from_zero(ax2, [0.02, 0.5, 1.1], cap=100) == "linear"
    assert ax2.get_ylim() == (0, pytest.approx(1.1 * 1.12))  # zoomed to the data, not 0-100%
    plt.close(fig)
    plt.close(fig2)


def test_step_functions_compare_and_average_over_time() -> None:
    assert same_steps([0, 10], [1, 2], [0, 5, 10], [1, 1, 2])
    assert not same_steps([0, 10], [1, 2], [0, 10], [1, 3])
    assert list(time_weighted_bins([0, 10], [1, 3], [0, 10, 20])) == [1, 3]
    assert list(time_weighted_bins([5], [2], [0, 10])) == [1]  # 0 before the first sample


# -- progress ------------------------------------------------------------------------------------


class Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_short_run_shows_no_progress() -> None:
    stream, clock = io.StringIO(), Ticks()
    with Progress(stream, clock=clock, terminal=False) as progress:
        progress.step("replaying gpush", 100, "jobs")
        clock.now = 1.0
        progress.update(50)
    assert stream.getvalue() == ""


def test_a_long_run_shows_a_line_every_few_seconds_and_at_each_step() -> None:
    stream, clock = io.StringIO(), Ticks()
    with Progress(stream, clock=clock, terminal=False, quiet=2, every=5) as progress:
        progress.step("replaying gpush (fgd)", 7064, "jobs")
        clock.now = 2.5
        progress.update(3000)
        clock.now = 4.0
        progress.update(5000)  # not 5 s since the last line: nothing
        clock.now = 8.0
        progress.update(6000)
        progress.step("drawing the plots", 7, "plots")
        clock.now = 12.0
    lines = stream.getvalue().splitlines()
    assert lines == [
        "gpush simulate: replaying gpush (fgd): 3,000 of 7,064 jobs (2s so far)",
        "gpush simulate: replaying gpush (fgd): 6,000 of 7,064 jobs (8s so far)",
        "gpush simulate: drawing the plots (8s so far)",
        "gpush simulate: done in 12s",
    ]


def test_on_a_terminal_progress_is_a_bar_that_goes_away() -> None:
    stream, clock = io.StringIO(), Ticks()
    progress = Progress(stream, clock=clock, terminal=True, quiet=0)
    progress.step("replaying", 10, "jobs")
    assert progress._bar is not None
    progress.close()
    assert progress._bar is None


def test_silent_progress_is_the_default(tmp_path: Path, capsys) -> None:
    demo(tmp_path, plots=False)
    assert capsys.readouterr().err == ""
    assert isinstance(Silent(), Silent)
