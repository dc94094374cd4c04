//! The delay line behind the net-lag fault. While the fault lasts, the
//! stack sends every TCP packet between the services and the Kafka nodes to
//! an NFQUEUE (`STACK_SCRIPT net lag on QUEUE`); a thread here takes each
//! packet, drops it with the fault's loss probability or holds it for the
//! one-way delay, then lets it through. Linux's netem does the same in the
//! kernel, but the kernels these runs are made on are built without it
//! (`CONFIG_NET_SCH_NETEM` unset); NFQUEUE is there, and a held packet is as
//! late to TCP as a netem'd one (within the thread's 1 ms tick).
//!
//! The rule passes packets straight through while no one reads the queue
//! (`--queue-bypass`), and the kernel drops what a reader held when it goes
//! away, so a chaos killed mid-fault leaves a network that works (TCP sends
//! those again).

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nfq::{Message, Queue, Verdict};
use rand::Rng;

/// How often the line looks for packets that are due, at most.
const TICK: Duration = Duration::from_millis(1);

/// What the line does to each packet.
#[derive(Debug, Clone, Copy)]
pub struct Lag {
    /// How long each packet is held.
    pub one_way: Duration,
    /// The probability that a packet is dropped instead (0 to 1).
    pub loss: f64,
}

/// What the line did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Packets let through (late).
    pub passed: u64,
    /// Packets dropped.
    pub dropped: u64,
    /// Most packets held at once.
    pub most_held: usize,
}

/// A running delay line on one queue.
pub struct DelayLine {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<io::Result<Stats>>,
}

impl DelayLine {
    /// Binds NFQUEUE `queue` (root only; an error if another reader has it)
    /// and starts the line's thread.
    pub fn start(queue: u16, lag: Lag) -> io::Result<Self> {
        let mut q = Queue::open()?;
        q.bind(queue)?;
        // Metadata only: the line never looks inside a packet.
        q.set_copy_range(queue, 0)?;
        // Whole segments as the sender handed them over (no software
        // segmentation on the way into the queue).
        q.set_recv_gso(queue, true)?;
        // Room for every packet of a 200 ms delay under load; past it the
        // kernel passes packets through rather than drop them.
        q.set_queue_max_len(queue, 65_536)?;
        q.set_fail_open(queue, true)?;
        q.set_nonblocking(true);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("chaos-delay-line".into())
            .spawn(move || run(q, queue, lag, &flag))?;
        Ok(Self { stop, thread })
    }

    /// Lets every held packet through, unbinds the queue and says what the
    /// line did. Remove the rule first (`net lag off`), or packets that come
    /// after pass unheld (the queue then has no reader).
    pub fn stop(self) -> io::Result<Stats> {
        self.stop.store(true, Ordering::Release);
        self.thread
            .join()
            .map_err(|_| io::Error::other("the delay line's thread panicked"))?
    }
}

fn run(mut q: Queue, queue: u16, lag: Lag, stop: &AtomicBool) -> io::Result<Stats> {
    let mut held: VecDeque<(Instant, Message)> = VecDeque::new();
    let mut stats = Stats::default();
    let mut rng = rand::rng();
    loop {
        let stopping = stop.load(Ordering::Acquire);
        loop {
            match q.recv() {
                Ok(mut msg) => {
                    if !stopping && rng.random_bool(lag.loss) {
                        msg.set_verdict(Verdict::Drop);
                        q.verdict(msg)?;
                        stats.dropped += 1;
                    } else {
                        msg.set_verdict(Verdict::Accept);
                        held.push_back((Instant::now() + lag.one_way, msg));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        stats.most_held = stats.most_held.max(held.len());
        let now = Instant::now();
        // One delay for all, so the packets fall due in the order they came.
        while held.front().is_some_and(|(due, _)| stopping || *due <= now) {
            if let Some((_, msg)) = held.pop_front() {
                q.verdict(msg)?;
                stats.passed += 1;
            }
        }
        if stopping {
            break;
        }
        let next = held.front().map_or(TICK, |(due, _)| {
            due.saturating_duration_since(now).min(TICK)
        });
        std::thread::sleep(next.max(Duration::from_micros(100)));
    }
    let _ = q.unbind(queue);
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::process::Command;

    use super::*;

    /// An iptables rule that sends the client's packets to `port` on
    /// 127.0.0.1 through NFQUEUE `queue`, in a chain of the test's own;
    /// removed on drop.
    struct Rule {
        chain: String,
    }

    fn iptables(args: &[&str]) -> bool {
        Command::new("iptables")
            .arg("-w")
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    }

    impl Rule {
        fn insert(port: u16, queue: u16) -> Self {
            let chain = format!("EFF-TEST-{}", std::process::id());
            let port = port.to_string();
            let queue = queue.to_string();
            assert!(iptables(&["-N", &chain]), "iptables -N {chain}");
            let rule = Self { chain };
            assert!(iptables(&["-I", "OUTPUT", "-j", &rule.chain]));
            assert!(iptables(&[
                "-A",
                &rule.chain,
                "-o",
                "lo",
                "-p",
                "tcp",
                "-d",
                "127.0.0.1",
                "--dport",
                &port,
                "-j",
                "NFQUEUE",
                "--queue-num",
                &queue,
                "--queue-bypass",
            ]));
            rule
        }
    }

    impl Drop for Rule {
        fn drop(&mut self) {
            iptables(&["-D", "OUTPUT", "-j", &self.chain]);
            iptables(&["-F", &self.chain]);
            iptables(&["-X", &self.chain]);
        }
    }

    /// The median of `n` one-byte round trips.
    fn round_trip(client: &mut TcpStream, n: usize) -> Duration {
        let mut times: Vec<Duration> = (0..n)
            .map(|_| {
                let start = Instant::now();
                client.write_all(b"x").expect("write");
                let mut b = [0u8; 1];
                client.read_exact(&mut b).expect("read the echo");
                start.elapsed()
            })
            .collect();
        times.sort();
        times[n / 2]
    }

    #[test]
    fn packets_through_the_line_come_late_and_some_are_dropped_and_sent_again() {
        use std::os::unix::fs::MetadataExt;
        let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
        if !root {
            eprintln!("skipped: the delay line needs root (NFQUEUE, iptables)");
            return;
        }
        assert!(
            Command::new("iptables").arg("-V").output().is_ok(),
            "iptables missing (scripts/stack.sh up installs it as root)"
        );
        let server = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = server.local_addr().expect("addr").port();
        let echo = std::thread::spawn(move || {
            let (mut s, _) = server.accept().expect("accept");
            let mut b = [0u8; 64];
            loop {
                match s.read(&mut b) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => s.write_all(&b[..n]).expect("echo"),
                }
            }
        });
        let queue = 4000 + (std::process::id() % 1000) as u16;
        let _rule = Rule::insert(port, queue);
        let mut client = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        client.set_nodelay(true).expect("nodelay");
        client
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");

        // No reader: the rule passes packets straight through.
        let direct = round_trip(&mut client, 20);

        let one_way = Duration::from_millis(40);
        let line = DelayLine::start(queue, Lag { one_way, loss: 0.0 }).expect("start");
        let late = round_trip(&mut client, 10);
        let stats = line.stop().expect("stop");
        assert!(late >= one_way, "{late:?} under the delay {one_way:?}");
        assert!(
            late < direct + one_way + Duration::from_millis(50),
            "{late:?}: more than the delay over {direct:?}"
        );
        assert!(stats.passed >= 10, "{stats:?}");
        assert_eq!(stats.dropped, 0);

        // A quarter dropped: TCP sends them again, every byte comes back.
        // 60 round trips: ten let no drop through once in 18 runs (0.75^10),
        // which failed a CI run; at 60 it is 3 in 100 million.
        let lossy = Lag {
            one_way: Duration::from_millis(1),
            loss: 0.25,
        };
        let line = DelayLine::start(queue, lossy).expect("start");
        round_trip(&mut client, 60);
        let stats = line.stop().expect("stop");
        assert!(stats.dropped > 0, "{stats:?}");

        // Stopped: straight through again.
        assert!(round_trip(&mut client, 5) < one_way);
        drop(client);
        echo.join().expect("echo thread");
    }
}
