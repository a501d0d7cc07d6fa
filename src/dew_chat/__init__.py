"""The verifiers harness plugin `dew-chat`: dew's in-process chat loop (`dew.envs.verifiers`).

verifiers finds a harness by its id as an installed package that exports its `Harness`
subclass in `__all__`; `dew.envs.verifiers` runs every agent of a verifiers environment with it.
"""

from dew.envs.verifiers import ChatHarness, ChatHarnessConfig

__all__ = ["ChatHarness", "ChatHarnessConfig"]
