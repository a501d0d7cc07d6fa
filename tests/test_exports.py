"""The public surface docs/scheduler.md names: names, signatures and defaults."""

from __future__ import annotations

import inspect

import attrs

import dew.data
import dew.objectives.rl.grpo as grpo
import dew.objectives.rl.scheduler as scheduler
import dew.objectives.rl.sessions as sessions

P = inspect.Parameter


def parameters(function) -> list[tuple[str, object, object]]:
    return [
        (p.name, p.kind, p.default)
        for p in inspect.signature(function).parameters.values()
        if p.name != "self"
    ]


def test_the_scheduler_module_names_the_pages_names():
    for name in ("Publisher", "SchedulerRecord", "task_ids", "RolloutScheduler"):
        assert hasattr(scheduler, name), name


def test_rollout_scheduler_signature_is_the_pages():
    keyword = P.KEYWORD_ONLY
    assert parameters(scheduler.RolloutScheduler.__init__) == [
        ("objective", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("source", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("weights", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("width", keyword, P.empty),
        ("rows", keyword, P.empty),
        ("tasks", keyword, scheduler.task_ids),
        ("groups", keyword, 4),
        ("oversample", keyword, 0),
        ("admit", keyword, None),
        ("max_lag", keyword, 1),
        ("ahead", keyword, 1),
        ("sync_every", keyword, 1),
        ("max_attempts", keyword, 3),
        ("timeout", keyword, None),
        ("estimator", keyword, "group"),
        ("truncation", keyword, "mask"),
        ("support_capacity", keyword, None),
        ("log", keyword, None),
        ("vocab", keyword, None),
        ("empty_streak", keyword, 5),
        ("filter_uniform", keyword, False),
        ("reference", keyword, None),
        ("carry_over", keyword, False),
        ("waste_budget", keyword, 0.2),
        ("hedge", keyword, True),
        ("narrow", keyword, False),
        ("align_starts", keyword, None),
    ]
    assert [p[0] for p in parameters(scheduler.RolloutScheduler.tasks)] == ["dataset"]
    assert parameters(scheduler.RolloutScheduler.close) == []
    rollout = ["batch", "variables", "updates"]
    assert [p[0] for p in parameters(scheduler.RolloutScheduler.__call__)] == rollout
    assert [p[0] for p in parameters(scheduler.RolloutScheduler.step)] == rollout
    assert inspect.iscoroutinefunction(scheduler.RolloutScheduler.step)


def test_scheduler_record_fields_are_the_pages_in_order():
    assert [f.name for f in attrs.fields(scheduler.SchedulerRecord)] == [
        "updates",
        "version",
        "lag",
        "groups",
        "resubmitted",
        "cancelled",
        "abandoned",
        "cut",
        "waited",
        "metrics",
    ]


def test_publisher_and_task_ids():
    assert [p[0] for p in parameters(scheduler.Publisher.load)] == ["variables", "version"]
    assert [p[0] for p in parameters(scheduler.task_ids)] == ["batch"]


def test_the_modules_around_the_scheduler():
    for name in (
        "Status",
        "Call",
        "Session",
        "Label",
        "SessionSource",
        "SessionError",
        "check_session",
        "chains",
        "pack",
        "session_metrics",
    ):
        assert hasattr(sessions, name), name
    assert [m.name for m in sessions.Status] == [
        "COMPLETED",
        "AGENT_ERROR",
        "TRUNCATED",
        "INFRA_ERROR",
        "CANCELLED",
    ]
    assert [f.name for f in attrs.fields(sessions.Label)] == ["group", "sample", "attempt"]
    assert parameters(sessions.pack)[1:] == [
        ("width", P.KEYWORD_ONLY, P.empty),
        ("rows", P.KEYWORD_ONLY, P.empty),
        ("estimator", P.KEYWORD_ONLY, "group"),
        ("truncation", P.KEYWORD_ONLY, "mask"),
        ("support_capacity", P.KEYWORD_ONLY, None),
    ]
    for method in ("packed_log_probs", "behavior_importance", "loss"):
        assert callable(getattr(grpo.GRPOObjective, method)), method
    for name in ("Task", "Batch", "Dataset", "ArrayDataset"):
        assert hasattr(dew.data, name), name
    assert [p[0] for p in parameters(dew.data.ArrayDataset.stream)] == ["start"]


def test_the_checkpoint_tokenizer_surface_is_the_docs():
    """docs/gateway.md's `TemplateTokenizer.from_folder` and the renderer it names."""
    import dew.serve
    from dew.serve import chat_template, tokenizer

    assert {"chat_template", "tokenizer"} <= set(dew.serve.__all__)
    for name in ("ChatTemplate", "ChatTemplateError", "SPECIAL_TOKEN_NAMES"):
        assert hasattr(chat_template, name), name
    keyword = P.KEYWORD_ONLY
    assert parameters(tokenizer.TemplateTokenizer.from_folder) == [
        ("folder", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("chat_template", keyword, None),
        ("template_kwargs", keyword, None),
    ]
    assert parameters(chat_template.ChatTemplate.render) == [
        ("messages", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("tools", keyword, None),
        ("add_generation_prompt", keyword, False),
        ("kwargs", P.VAR_KEYWORD, P.empty),
    ]
