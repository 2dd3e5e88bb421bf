"""The synthetic store's optional workloads (``write_run(sessions=..., speculative=...)``): off by default, and
when on, rows that keep the schema's contracts and that the analyzers read as the modules describe them; the
session and speculation analyses (and a diff) give the same answers from the run's derived facts as from its
part files; the Sessions view lists a bounded part of a run with many sessions."""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic_sessions import BLOCK_TOKENS, TTL_NS
from synthetic_store import SLO_CLASSES, write_run

from analyzers.analysis import RunAnalysis
from tokentrace.schema import CACHE_EVENTS, REQUESTS, SPANS, SPEC_STEPS, CacheEventKind, Stage, col
from tokentrace.store.reader import open_run

NUM_REQUESTS = 3000


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("workloads")
    write_run(root, "plain", num_requests=300, mean_output_tokens=4.0, rate_rps=500.0)
    write_run(root, "both", num_requests=NUM_REQUESTS, mean_output_tokens=4.0, rate_rps=500.0, sessions=0.3,
              speculative=True)
    return root


def _analysis(store: Path, run_id: str) -> RunAnalysis:
    return RunAnalysis(open_run(store, run_id))


def test_without_the_options_no_request_has_a_session_and_no_step_speculates(store: Path) -> None:
    src = _analysis(store, "plain").source
    assert src.scalar(f"SELECT COUNT(*) FROM {REQUESTS.name} WHERE {col.SESSION} IS NOT NULL") == 0
    assert src.scalar(f"SELECT COUNT(*) FROM {SPEC_STEPS.name}") == 0
    kinds = {int(k) for k in src.df(f"SELECT DISTINCT {col.KIND} FROM {CACHE_EVENTS.name}")[col.KIND]}
    assert kinds.isdisjoint({CacheEventKind.RETAIN, CacheEventKind.DROP, CacheEventKind.CARRY})
    assert _analysis(store, "plain").sessions().empty


def test_session_turns_carry_what_the_previous_turn_computed(store: Path) -> None:
    rep = _analysis(store, "both").sessions()
    turns = rep.turns
    assert 0.25 * NUM_REQUESTS <= len(turns) <= 0.3 * NUM_REQUESTS
    assert turns.groupby(col.SESSION)["turn"].apply(lambda t: list(t) == list(range(len(t)))).all()
    assert (turns.groupby(col.SESSION)[col.TENANT].nunique() == 1).all()
    later = turns[turns["turn"] > 0]
    prev = turns.groupby(col.SESSION).shift(1).loc[later.index]
    assert (later["think_ms"] > 0).all()  # every turn arrives after the previous one finished
    assert (later[col.NUM_PROMPT_TOKENS] >= prev[col.NUM_PROMPT_TOKENS] + prev[col.NUM_OUTPUT_TOKENS] + 16).all()
    computed = (prev[col.NUM_PROMPT_TOKENS] + prev[col.NUM_OUTPUT_TOKENS] - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert (later["carried_tokens"] == computed).all()  # the last sampled token is never fed back
    assert (later["reused_tokens"] == later[col.NUM_CACHED_TOKENS]).all()  # reused from the device tier
    assert (later["reused_tokens"] == later["reused_device_tokens"]).all()
    slo = _analysis(store, "both").source.df(
        f"SELECT DISTINCT {col.REQUEST_ID}, {col.SLO_CLASS} FROM srv_requests").set_index(col.REQUEST_ID)[col.SLO_CLASS]
    batch = later[slo.loc[later[col.REQUEST_ID]].to_numpy() == SLO_CLASSES[1]]
    interactive = later[slo.loc[later[col.REQUEST_ID]].to_numpy() == SLO_CLASSES[0]]
    assert len(batch) and (batch["lost_tokens"] == batch["carried_tokens"]).all()  # dropped at each turn's end
    within_ttl = interactive[interactive["think_ms"] < TTL_NS / 1e6]
    assert len(within_ttl) and (within_ttl["lost_tokens"] == 0).all()  # still pinned at the next admission
    r = rep.retention.iloc[0]
    assert r["retained_blocks"] > 0 and r["dropped_blocks"] > 0 and 0 < r["reuse_fraction"] < 1
    assert 0 < r["mean_retain_ms"] <= TTL_NS / 1e6
    assert len(rep.fairness) == 3


def test_speculative_steps_tile_every_token_as_the_contract_says(store: Path) -> None:
    analysis = _analysis(store, "both")
    src = analysis.source
    attribution = analysis.attribution().set_index("kind")
    assert attribution.loc["all", "unattributed_share"] == 0 and attribution.loc["all", "overlap_share"] == 0
    # the step's first token carries decode.draft and decode.verify, back to back and on the spec_steps row's step
    joined = src.df(f"""
        SELECT COUNT(*) AS n,
               SUM(CASE WHEN d.{col.START_NS} = p.{col.DRAFT_START_NS} AND d.{col.END_NS} = p.{col.DRAFT_END_NS}
                         AND v.{col.START_NS} = p.{col.VERIFY_START_NS} AND v.{col.END_NS} = p.{col.VERIFY_END_NS}
                         AND d.{col.STEP} = p.{col.STEP} AND v.{col.STEP} = p.{col.STEP} THEN 1 ELSE 0 END) AS ok
        FROM {SPEC_STEPS.name} p
        JOIN {SPANS.name} d ON d.{col.REQUEST_ID} = p.{col.REQUEST_ID}
             AND d.{col.TOKEN_INDEX} = p.{col.FIRST_TOKEN_INDEX} AND d.{col.STAGE} = {int(Stage.DECODE_DRAFT)}
        JOIN {SPANS.name} v ON v.{col.REQUEST_ID} = p.{col.REQUEST_ID}
             AND v.{col.TOKEN_INDEX} = p.{col.FIRST_TOKEN_INDEX} AND v.{col.STAGE} = {int(Stage.DECODE_VERIFY)}
    """).iloc[0]
    spec_rows = src.scalar(f"SELECT COUNT(*) FROM {SPEC_STEPS.name}")
    assert spec_rows > 0 and joined["n"] == spec_rows and joined["ok"] == spec_rows
    rep = analysis.speculation()
    s = rep.summary.iloc[0]
    assert s["num_steps"] == spec_rows and s["draft_sources"] == "model, ngram" and s["max_proposed"] == 4
    assert 0 < s["acceptance_rate"] < 1
    assert s["num_steps"] < s["num_emitted"] <= s["num_steps"] + s[col.NUM_ACCEPTED]  # a + 1 each, fewer at the end
    assert set(rep.itl["mode"]) == {"speculative", "plain"}
    assert len(rep.neighbours) == 2  # steps with and without speculating requests
    assert (rep.by_position["num_steps"].diff().dropna() <= 0).all()


def test_the_sessions_view_lists_a_bounded_part_of_many_sessions(tmp_path: Path) -> None:
    from dash import dash_table, html

    from dashboard.app import create_app
    from dashboard.components.shell import ViewQuery
    from dashboard.data import DataSource

    write_run(tmp_path, "many", num_requests=20_000, mean_output_tokens=2.0, rate_rps=500.0, sessions=0.3)
    create_app(tmp_path)  # registers the pages
    from dashboard.pages import sessions as view
    src = DataSource(tmp_path)
    rep = src.result("many", RunAnalysis.sessions)
    assert len(rep.sessions) > view.MAX_LISTED_SESSIONS
    found: dict[str, object] = {}

    def walk(node: object) -> None:
        if isinstance(node, dash_table.DataTable):
            found[node.id] = node.data
        elif isinstance(node, html.P) and "are listed" in str(node.children):
            found.setdefault("notes", []).append(node.children)
        children = getattr(node, "children", None)
        if children is None or isinstance(children, str):
            return
        for child in children if isinstance(children, (list, tuple)) else [children]:
            walk(child)

    for part in view.body(src, ViewQuery(run="many")):
        walk(part)
    listed = found["sessions-table"]
    assert len(listed) == view.MAX_LISTED_SESSIONS
    by_sum = rep.sessions.sort_values("ttft_sum_ms", ascending=False)[col.SESSION]
    assert [row[col.SESSION] for row in listed] == sorted(by_sum.head(view.MAX_LISTED_SESSIONS))  # session order
    turns = found["sessions-turns"]
    assert {row[col.SESSION] for row in turns} == set(by_sum.head(view.MAX_LISTED_TURN_SESSIONS))
    assert len(turns) == rep.turns[col.SESSION].isin(by_sum.head(view.MAX_LISTED_TURN_SESSIONS)).sum()
    assert found["notes"] == [
        f"The 1,000 sessions with the longest TTFT sums are listed, of {len(rep.sessions):,} sessions.",
        f"The turns of the 200 sessions with the longest TTFT sums are listed, of {len(rep.sessions):,} sessions."]
