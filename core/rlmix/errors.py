"""Errors the CLI reports in one line, without a traceback."""


class RlmixError(Exception):
    """Base class of errors that are the user's to fix (bad manifest, missing plugin, ...)."""


class ManifestError(RlmixError):
    """The manifest is wrong: unknown key, wrong type, unknown plugin, hook without owner."""


class PluginError(RlmixError):
    """A plugin failed to import or to configure; the message names it."""


ConfigError = ManifestError  # what plugins raise from rlmix_configure for bad settings
