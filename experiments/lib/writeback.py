"""The page cache's writeback bursts: the kernel writing a few hundred MB of
dirty data back at once, which holds up the WAL's fsyncs behind it
(FINDINGS §14). A burst is the dirty data falling by BURST_MB or more within
a second; it lasts under a second, so it is watched ten times a second.

`bursts` finds them in a series of readings (bench-orders' per-point file);
`Watch` samples in a thread of its own and tells, interval by interval, the
largest fall within a second and the most dirty data (the acceptance run's
sampler, whose own samples are seconds apart).
"""
import collections
import threading
import time

BURST_MB = 64
WINDOW_S = 1.0


def read_meminfo(path="/proc/meminfo"):
    """(Dirty, Writeback) in kB, 0 for a line the file lacks."""
    kb = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Dirty", "Writeback"):
                fields = rest.split()
                if fields and fields[0].isdigit():
                    kb[name] = int(fields[0])
    return kb.get("Dirty", 0), kb.get("Writeback", 0)


class Window:
    """The readings of the last WINDOW_S seconds, for the fall within it."""

    def __init__(self, window_s=WINDOW_S):
        self.window_s = window_s
        self.recent = collections.deque()  # (time, dirty kB)

    def push(self, t, dirty_kb):
        """The most dirty data of the readings within WINDOW_S before T
        (None without one); then keeps this reading."""
        while self.recent and t - self.recent[0][0] > self.window_s:
            self.recent.popleft()
        top = max((d for _, d in self.recent), default=None)
        self.recent.append((t, dirty_kb))
        return top


def bursts(readings, burst_mb=BURST_MB, window_s=WINDOW_S, gap_s=2.0):
    """The bursts in READINGS, (unix time, dirty kB) in time order: each as
    (time, dirty kB at the window's most, dirty kB after), where the dirty data
    fell by BURST_MB or more within WINDOW_S; a fall within GAP_S of the last
    one found is the same burst."""
    out, last = [], None
    window = Window(window_s)
    for t, dirty in readings:
        top = window.push(t, dirty)
        if top is not None and top - dirty >= burst_mb * 1024 and (last is None or t - last > gap_s):
            out.append((t, top, dirty))
            last = t
    return out


class Watch:
    """Reads the dirty data every INTERVAL seconds in a daemon thread.
    `take()` returns, for the readings since the previous take: the most dirty
    data and the largest fall within WINDOW_S, in MB (a window may start in the
    interval before), or None before any reading."""

    def __init__(self, interval=0.1, meminfo="/proc/meminfo", window_s=WINDOW_S):
        self.interval, self.meminfo = interval, meminfo
        self.lock = threading.Lock()
        self.window = Window(window_s)
        self.max_kb = self.fall_kb = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=1.0)

    def add(self, t, dirty_kb):
        """One reading (the thread's, or a test's)."""
        with self.lock:
            top = self.window.push(t, dirty_kb)
            top = dirty_kb if top is None else top
            self.max_kb = dirty_kb if self.max_kb is None else max(self.max_kb, dirty_kb)
            fall = max(0, top - dirty_kb)
            self.fall_kb = fall if self.fall_kb is None else max(self.fall_kb, fall)

    def take(self):
        with self.lock:
            if self.max_kb is None:
                return None
            out = {"dirty_max_mb": round(self.max_kb / 1024), "dirty_fall_mb": round(self.fall_kb / 1024)}
            self.max_kb = self.fall_kb = None
            return out

    def _run(self):
        while not self.stopped.is_set():
            t = time.time()
            try:
                dirty, _ = read_meminfo(self.meminfo)
            except OSError:
                return  # no /proc/meminfo: the columns stay empty
            self.add(t, dirty)
            self.stopped.wait(max(0.0, self.interval - (time.time() - t)))
