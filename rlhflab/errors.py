"""Errors that speak to the user.

Bad input (a config key, a dataset row, a model path, a web request) raises
`UserError` with one line that names the thing and the fix. The CLI prints it as
``error: <message>`` and exits with status 2, without a traceback.
"""


class UserError(Exception):
    """Bad input from the user; the message names the thing and the fix."""


class ConfigError(UserError):
    """A config file or override is invalid (unknown key, wrong type, out of range)."""


class TrainingDiverged(UserError):
    """The loss, the gradient norm or the model's forward pass stopped being finite.

    The message names the step and the knob to turn (usually the learning rate); the
    newest checkpoint on disk is one whose forward pass was checked finite.
    """
