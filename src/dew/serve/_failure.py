"""CallFailed: an engine call lost to the infrastructure, which sources report as INFRA_ERROR."""


class CallFailed(RuntimeError):
    """An engine call that failed for a reason outside the policy and its rollout.

    A remote engine raises it when the server holding the call dies or drops it. A source turns
    it into an `INFRA_ERROR` session, which the scheduler resubmits under its rules, where any
    other exception from the engine (a misconfigured server, a bad request) stops the run.
    """
