"""The bubblewrap sandbox shared by every environment that runs model-written code."""

from environments.sandbox.sandbox import (Limits, RequestFailed, RunResult, Sandbox, SandboxError, SandboxUnavailable,
                                         check_available)

__all__ = ["Limits", "RequestFailed", "RunResult", "Sandbox", "SandboxError", "SandboxUnavailable", "check_available"]
