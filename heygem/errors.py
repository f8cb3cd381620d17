"""The one exception type for problems a user can fix."""


class HeygemError(Exception):
    """A problem with the user's input or options; the message says what to do.

    The CLI prints it on one line and exits with status 2; the web app and the
    REST API show it as the job's error.
    """


class GenerationCancelled(Exception):
    """Raised inside a generation when its ``should_stop`` callback asks it to stop."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name when it has none): for one-line reports."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
