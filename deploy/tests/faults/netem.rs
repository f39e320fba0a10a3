//! A network namespace for the cards, joined to this one by a link that loses, delays and
//! reorders packets: `tc netem` on a veth pair where the kernel has netem, else (kernels built
//! without `sch_netem`) a relay in this process between two TUN devices that does the same to
//! every IP packet. Needs root and `ip` (iproute2); without them the test is skipped, saying why.

use std::collections::BinaryHeap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::cluster::CardNet;

/// Loss, delay and reordering of the link, both ways.
const LOSS: f64 = 0.03;
const DELAY: Duration = Duration::from_millis(3);
const JITTER: Duration = Duration::from_millis(1);
const REORDER: f64 = 0.10;

/// The userspace relay's switch and counters.
#[derive(Default)]
pub struct Relay {
    stop: AtomicBool,
    /// Packets passed on, and dropped.
    passed: AtomicU64,
    dropped: AtomicU64,
}

/// The cards' namespace and the impaired link to it; removed when dropped.
pub struct ImpairedNet {
    ns: String,
    /// The link device on this side.
    host_dev: String,
    /// `Some` when the userspace relay impairs the link (no netem).
    relay: Option<Arc<Relay>>,
    host_ip: String,
    card_ip: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn in_ns(ns: &str, args: &[&str]) -> Result<(), String> {
    let mut all = vec!["netns", "exec", ns];
    all.extend_from_slice(args);
    ip(&all)
}

fn skip(why: &str) -> Option<ImpairedNet> {
    test_skips::skipped(&format!(
        "{why} (it needs root, network namespaces and iproute2; CI has them)"
    ));
    None
}

impl ImpairedNet {
    /// Makes the namespace and the link, or says why it cannot and returns `None`.
    pub fn create() -> Option<ImpairedNet> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return skip("not running as root");
        }
        let id = std::process::id() % 100_000;
        let ns = format!("afdt{id}");
        if let Err(e) = ip(&["netns", "add", &ns]) {
            return skip(&format!("no network namespaces here: {e}"));
        }
        let subnet = 16 + id % 200;
        let host_ip = format!("10.199.{subnet}.1");
        let card_ip = format!("10.199.{subnet}.2");
        let mut net = ImpairedNet {
            ns,
            host_dev: String::new(),
            relay: None,
            host_ip,
            card_ip,
        };
        match net.veth_with_netem(id) {
            Ok(()) => return Some(net),
            Err(e) => eprintln!("netem is not available ({e}); impairing the link in userspace"),
        }
        match net.tun_relay(id) {
            Ok(()) => Some(net),
            Err(e) => skip(&format!("cannot make the link: {e}")),
        }
    }

    fn veth_with_netem(&mut self, id: u32) -> Result<(), String> {
        let (host, card) = (format!("afdh{id}"), format!("afdc{id}"));
        ip(&["link", "add", &host, "type", "veth", "peer", "name", &card])?;
        self.host_dev = host.clone();
        ip(&["link", "set", &card, "netns", &self.ns])?;
        self.configure(&host, &card)?;
        let netem = |dev: &str, ns: Option<&str>| -> Result<(), String> {
            let mut cmd = match ns {
                Some(ns) => {
                    let mut c = Command::new("ip");
                    c.args(["netns", "exec", ns, "tc"]);
                    c
                }
                None => Command::new("tc"),
            };
            let out = cmd
                .args(["qdisc", "add", "dev", dev, "root", "netem"])
                .args(["delay", "3ms", "1ms", "loss", "3%", "reorder", "10%", "50%"])
                .output()
                .map_err(|e| format!("cannot run `tc`: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
            }
        };
        let added = netem(&host, None).and_then(|()| netem(&card, Some(&self.ns)));
        if added.is_err() {
            let _ = ip(&["link", "del", &host]);
            self.host_dev.clear();
        }
        added
    }

    /// Addresses and routes of the two ends (`host` here, `card` in the namespace).
    fn configure(&self, host: &str, card: &str) -> Result<(), String> {
        ip(&[
            "addr",
            "add",
            &self.host_ip,
            "peer",
            &self.card_ip,
            "dev",
            host,
        ])?;
        ip(&["link", "set", host, "up"])?;
        in_ns(&self.ns, &["ip", "link", "set", "lo", "up"])?;
        in_ns(
            &self.ns,
            &[
                "ip",
                "addr",
                "add",
                &self.card_ip,
                "peer",
                &self.host_ip,
                "dev",
                card,
            ],
        )?;
        in_ns(&self.ns, &["ip", "link", "set", card, "up"])
    }

    fn tun_relay(&mut self, id: u32) -> Result<(), String> {
        let (host, card) = (format!("afda{id}"), format!("afdb{id}"));
        let a = open_tun(&host)?;
        self.host_dev = host.clone();
        let b = open_tun(&card)?;
        ip(&["link", "set", &card, "netns", &self.ns])?;
        self.configure(&host, &card)?;
        let state = Arc::new(Relay::default());
        let (a, b) = (Arc::new(a), Arc::new(b));
        for (seed, from, to) in [(1u64, a.clone(), b.clone()), (2, b, a)] {
            let state = state.clone();
            std::thread::spawn(move || relay(&from, &to, seed, &state));
        }
        self.relay = Some(state);
        Ok(())
    }

    /// Where the cards run and bind, and where the node binds towards them.
    pub fn card_net(&self) -> CardNet {
        CardNet {
            card_ip: self.card_ip.clone(),
            node_ip: self.host_ip.clone(),
            wrap: vec!["ip".into(), "netns".into(), "exec".into(), self.ns.clone()],
        }
    }

    /// Packets the userspace relay passed on and dropped so far (`None` under netem).
    pub fn relayed(&self) -> Option<(u64, u64)> {
        self.relay.as_ref().map(|r| {
            (
                r.passed.load(Ordering::Relaxed),
                r.dropped.load(Ordering::Relaxed),
            )
        })
    }

    /// What impairs the link.
    pub fn describe(&self) -> String {
        let how = match self.relayed() {
            Some((passed, dropped)) => {
                format!("userspace relay over TUN, {passed} packets passed, {dropped} dropped")
            }
            None => "tc netem on veth".into(),
        };
        format!(
            "{how}: loss {:.0}%, delay {:?} ± {:?}, {:.0}% reordered, both ways",
            LOSS * 100.0,
            DELAY,
            JITTER,
            REORDER * 100.0
        )
    }
}

impl Drop for ImpairedNet {
    fn drop(&mut self) {
        if let Some(relay) = &self.relay {
            relay.stop.store(true, Ordering::Release);
        }
        let _ = ip(&["netns", "del", &self.ns]);
        if !self.host_dev.is_empty() {
            let _ = ip(&["link", "del", &self.host_dev]);
        }
    }
}

/// A TUN device named `name` (raw IP packets, no extra header).
fn open_tun(name: &str) -> Result<OwnedFd, String> {
    // SAFETY: a plain open(2) of a device path; the fd is owned from here on.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!("/dev/net/tun: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just opened and is not owned elsewhere.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // struct ifreq: the name, then the flags (a short) in the union.
    let mut req = [0u8; 40];
    req[..name.len()].copy_from_slice(name.as_bytes());
    let flags = (libc::IFF_TUN | libc::IFF_NO_PI) as i16;
    req[16..18].copy_from_slice(&flags.to_ne_bytes());
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    // SAFETY: TUNSETIFF reads and writes one struct ifreq, which `req` is large enough for.
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, req.as_mut_ptr()) } < 0 {
        return Err(format!(
            "TUNSETIFF {name}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(fd)
}

/// xorshift64*: enough randomness to pick packets.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Moves packets from `from` to `to`: a few percent lost, the rest delayed by a few ms with
/// jitter, and some sent at once, ahead of packets still delayed (reordering).
fn relay(from: &OwnedFd, to: &OwnedFd, seed: u64, state: &Relay) {
    let stop = &state.stop;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ seed);
    // Packets waiting, soonest first.
    let mut queue: BinaryHeap<std::cmp::Reverse<(Instant, u64, Vec<u8>)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::Acquire) {
        let now = Instant::now();
        while queue.peek().is_some_and(|p| p.0.0 <= now) {
            let Some(std::cmp::Reverse((_, _, packet))) = queue.pop() else {
                break;
            };
            // SAFETY: writes `packet.len()` bytes from a live buffer to an open fd.
            unsafe { libc::write(to.as_raw_fd(), packet.as_ptr().cast(), packet.len()) };
        }
        let wait = queue.peek().map_or(Duration::from_millis(50), |p| {
            p.0.0.saturating_duration_since(now)
        });
        let mut poll = libc::pollfd {
            fd: from.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = wait.as_millis().clamp(0, 50) as libc::c_int;
        // SAFETY: one pollfd, valid for the call.
        if unsafe { libc::poll(&mut poll, 1, ms) } <= 0 {
            continue;
        }
        // SAFETY: reads at most `buf.len()` bytes into a live buffer from an open fd.
        let n = unsafe { libc::read(from.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            if stop.load(Ordering::Acquire) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        if rng.unit() < LOSS {
            state.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        state.passed.fetch_add(1, Ordering::Relaxed);
        let delay = if rng.unit() < REORDER {
            Duration::ZERO
        } else {
            DELAY - JITTER + JITTER.mul_f64(2.0 * rng.unit())
        };
        seq += 1;
        queue.push(std::cmp::Reverse((
            Instant::now() + delay,
            seq,
            buf[..n as usize].to_vec(),
        )));
    }
}
