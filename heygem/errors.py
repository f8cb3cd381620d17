"""The one exception type for problems a user can fix."""


class HeygemError(Exception):
    """A problem with the user's input or options; the message says what to do.

    The CLI prints it on one line and exits with status 2; the web app and the
    REST API show it as the job's error.
    """


class GenerationCancelled(Exception):
    """Raised inside a generation when its ``should_stop`` callback asks it to stop."""
