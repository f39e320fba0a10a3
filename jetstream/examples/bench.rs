//! JetStream over QUIC against raw TCP, side by side in one process on loopback.
//!
//! (a) Round trip: a 4 KB write with an immediate, answered by a 4 KB write back, against a
//!     tokio TCP (TCP_NODELAY) ping-pong of 4 KB each way.
//! (b) Streaming: 368,640-byte writes (64 tokens x 2880 x bf16, one GPT-OSS-20B layer's hidden
//!     states at batch 64) against the same bytes over TCP.
//!
//! Two layouts, each measured side by side (rounds alternate between the transports so that
//! machine noise hits both):
//! - *two nodes*: node `attn` (the JetStream writer, the TCP client) and node `card` (the
//!   JetStream target, the TCP server) each run on their own thread with a single-threaded
//!   tokio runtime, as two processes would. Both transports use exactly these two threads.
//! - *one thread*: both nodes on one single-threaded runtime. Nothing ever sleeps between a
//!   send and its receipt, so this isolates each transport's CPU cost per message.
//!
//! Both layouts' figures are printed. The last line,
//! `rtt_ratio=<jetstream/tcp p50> throughput_ratio=<jetstream/tcp>`, takes the round trip from
//! the one-thread layout (the cost per message; with two threads, the wake-up latency of the
//! machine's idle CPUs is added to both transports and, on a virtual machine, swings between
//! runs) and the streaming from the two-node layout (sender and receiver on two cores).
//!
//! `cargo run --release -p jetstream --example bench [-- --rounds N] [--stats]`

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use jetstream::{
    ClusterCa, QuicConfig, QuicTransport, Region, RegionConfig, RegionDescriptor, Transport,
    WriteRequest,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;

const PING_BYTES: usize = 4096;
const LAYER_BYTES: usize = 64 * 2880 * 2;
const PINGS_PER_ROUND: usize = 4000;
const WARMUP_PINGS: usize = 500;
const LAYERS_PER_ROUND: usize = 1500;

type BenchResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn single_threaded_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

fn main() -> BenchResult<()> {
    let args: Vec<String> = std::env::args().collect();
    let rounds = args
        .iter()
        .skip_while(|arg| *arg != "--rounds")
        .nth(1)
        .map(|value| value.parse::<usize>())
        .transpose()?
        .unwrap_or(7);
    let stats = args.iter().any(|arg| arg == "--stats");

    println!("== one thread (both nodes on one runtime: CPU cost per message)");
    let one_thread = {
        let runtime = single_threaded_runtime()?;
        let handle = runtime.handle().clone();
        runtime.block_on(run(rounds, stats, handle))?
    };
    one_thread.print();

    println!("== two nodes (two threads, one runtime each)");
    // Node `card`: its own thread and runtime, serving until the measurements end.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (handle_sender, handle_receiver) = std::sync::mpsc::channel();
    let card_thread = std::thread::spawn(move || -> std::io::Result<()> {
        let runtime = single_threaded_runtime()?;
        let _ = handle_sender.send(runtime.handle().clone());
        runtime.block_on(async {
            let _ = stopped.await;
        });
        Ok(())
    });
    let card_node = handle_receiver.recv()?;
    // Node `attn`: this thread.
    let two_nodes = single_threaded_runtime()?.block_on(run(rounds, stats, card_node));
    let _ = stop.send(());
    card_thread
        .join()
        .map_err(|_| "the card thread panicked")??;
    let two_nodes = two_nodes?;
    two_nodes.print();

    println!(
        "two nodes:  rtt_ratio={:.3} throughput_ratio={:.3}",
        two_nodes.rtt_ratio(),
        two_nodes.throughput_ratio()
    );
    println!(
        "one thread: rtt_ratio={:.3} throughput_ratio={:.3}",
        one_thread.rtt_ratio(),
        one_thread.throughput_ratio()
    );
    // Round trips from the one-thread layout (per-message cost, free of the machine's thread
    // wake-up latency, which on a virtual machine swings with idle-state heuristics), streaming
    // from the two-node layout (sender and receiver pipelined on two cores, as on two hosts).
    println!(
        "rtt_ratio={:.3} throughput_ratio={:.3}",
        one_thread.rtt_ratio(),
        two_nodes.throughput_ratio()
    );
    Ok(())
}

/// Side-by-side figures of one layout.
struct Figures {
    tcp_p50: Duration,
    tcp_p99: Duration,
    js_p50: Duration,
    js_p99: Duration,
    samples: usize,
    tcp_throughput: f64,
    js_throughput: f64,
    rounds: usize,
}

impl Figures {
    fn rtt_ratio(&self) -> f64 {
        self.js_p50.as_secs_f64() / self.tcp_p50.as_secs_f64()
    }

    fn throughput_ratio(&self) -> f64 {
        self.js_throughput / self.tcp_throughput
    }

    fn print(&self) {
        println!("round trip, 4 KB each way ({} samples each):", self.samples);
        println!(
            "  tcp        p50 {:>8.1} us  p99 {:>8.1} us",
            micros(self.tcp_p50),
            micros(self.tcp_p99)
        );
        println!(
            "  jetstream  p50 {:>8.1} us  p99 {:>8.1} us",
            micros(self.js_p50),
            micros(self.js_p99)
        );
        println!(
            "streaming, {LAYER_BYTES}-byte writes (median of {} rounds):",
            self.rounds
        );
        println!("  tcp        {:>6.2} GB/s", self.tcp_throughput / 1e9);
        println!("  jetstream  {:>6.2} GB/s", self.js_throughput / 1e9);
    }
}

async fn run(rounds: usize, stats: bool, card_node: Handle) -> BenchResult<Figures> {
    let ca = ClusterCa::generate()?;
    let loopback: SocketAddr = "127.0.0.1:0".parse()?;
    let card_identity = ca.issue("card")?;
    // Bound on the card's runtime, so that its endpoint and receive tasks run there.
    let card = card_node
        .spawn(async move { QuicTransport::bind(QuicConfig::new(card_identity, loopback)) })
        .await??;
    let card = Arc::new(card);
    let mut attn_config = QuicConfig::new(ca.issue("attn")?, loopback);
    attn_config.peers.insert("card".into(), card.local_addr()?);
    let attn = Arc::new(QuicTransport::bind(attn_config)?);
    attn.connect("card").await?;

    let tcp_rtt = TcpPingPong::start(&card_node).await?;
    let js_rtt = JetPingPong::start(attn.clone(), card.clone(), &card_node)?;
    let mut tcp_samples = Vec::new();
    let mut js_samples = Vec::new();
    let mut tcp_rate = Vec::new();
    let mut js_rate = Vec::new();
    tcp_rtt.measure(WARMUP_PINGS).await?;
    js_rtt.measure(WARMUP_PINGS).await?;
    for round in 0..rounds {
        let tcp_round = tcp_rtt.measure(PINGS_PER_ROUND).await?;
        let js_round = js_rtt.measure(PINGS_PER_ROUND).await?;
        let tcp = tcp_stream(&card_node, LAYERS_PER_ROUND).await?;
        let js = jet_stream(&attn, &card, &card_node, LAYERS_PER_ROUND).await?;
        println!(
            "round {round}: round trip p50 tcp {:.1} us, jetstream {:.1} us; \
             streaming tcp {:.2} GB/s, jetstream {:.2} GB/s",
            micros(percentiles(&tcp_round).0),
            micros(percentiles(&js_round).0),
            tcp / 1e9,
            js / 1e9
        );
        tcp_samples.extend(tcp_round);
        js_samples.extend(js_round);
        tcp_rate.push(tcp);
        js_rate.push(js);
    }
    if stats {
        println!(
            "attn -> card connection: {:#?}",
            attn.connection_stats("card")
        );
    }
    let (tcp_p50, tcp_p99) = percentiles(&tcp_samples);
    let (js_p50, js_p99) = percentiles(&js_samples);
    Ok(Figures {
        tcp_p50,
        tcp_p99,
        js_p50,
        js_p99,
        samples: tcp_samples.len(),
        tcp_throughput: median(tcp_rate),
        js_throughput: median(js_rate),
        rounds,
    })
}

fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

/// The median and 99th percentile of `samples` (loadtest's statistics: numpy's linear
/// interpolation, as the other benchmarks report them).
fn percentiles(samples: &[Duration]) -> (Duration, Duration) {
    let mut seconds: Vec<f64> = samples.iter().map(Duration::as_secs_f64).collect();
    seconds.sort_by(f64::total_cmp);
    let at = |p: f64| Duration::from_secs_f64(interpolated(&seconds, p));
    (at(50.0), at(99.0))
}

/// The `p`th percentile of `sorted`, linear between the two nearest ranks (numpy's default, as
/// afd-loadtest reports percentiles); 0 when empty. Written here so that JetStream, which
/// uses no crate of ours, needs none for its benchmark either.
fn interpolated(sorted: &[f64], p: f64) -> f64 {
    let Some(last) = sorted.len().checked_sub(1) else {
        return 0.0;
    };
    let rank = (p / 100.0).clamp(0.0, 1.0) * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// Median of `v`; NaN when empty.
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    interpolated(&v, 50.0)
}

/// TCP ping-pong: the client sends 4 KB, the server (on the card node) reads them and sends
/// 4 KB back.
struct TcpPingPong {
    stream: tokio::sync::Mutex<TcpStream>,
}

impl TcpPingPong {
    async fn start(card_node: &Handle) -> BenchResult<Self> {
        let listener = card_node
            .spawn(async { TcpListener::bind("127.0.0.1:0").await })
            .await??;
        let addr = listener.local_addr()?;
        card_node.spawn(async move {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let _ = socket.set_nodelay(true);
            let mut buffer = vec![0u8; PING_BYTES];
            let reply = vec![7u8; PING_BYTES];
            while socket.read_exact(&mut buffer).await.is_ok() {
                if socket.write_all(&reply).await.is_err() {
                    return;
                }
            }
        });
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream: tokio::sync::Mutex::new(stream),
        })
    }

    async fn measure(&self, count: usize) -> BenchResult<Vec<Duration>> {
        let mut stream = self.stream.lock().await;
        let request = vec![1u8; PING_BYTES];
        let mut reply = vec![0u8; PING_BYTES];
        let mut samples = Vec::with_capacity(count);
        for _ in 0..count {
            let start = Instant::now();
            stream.write_all(&request).await?;
            stream.read_exact(&mut reply).await?;
            samples.push(start.elapsed());
        }
        Ok(samples)
    }
}

/// JetStream ping-pong: attn writes 4 KB with an immediate into the card's inbox; the card
/// reads them in place and writes 4 KB back into attn's region with the same immediate.
struct JetPingPong {
    attn: Arc<QuicTransport>,
    inbox: RegionDescriptor,
    replies: Region,
}

impl JetPingPong {
    fn start(
        attn: Arc<QuicTransport>,
        card: Arc<QuicTransport>,
        card_node: &Handle,
    ) -> BenchResult<Self> {
        let inbox = card.register(RegionConfig::new(PING_BYTES).grant("attn"))?;
        let replies = attn.register(RegionConfig::new(PING_BYTES).grant("card"))?;
        let inbox_descriptor = inbox.descriptor();
        let reply_target = replies.descriptor();
        card_node.spawn(async move {
            let answer = Bytes::from(vec![7u8; PING_BYTES]);
            while let Ok(done) = inbox.next_completion().await {
                let checksum = match inbox.read(done.range()).await {
                    Ok(view) => view[0],
                    Err(_) => return,
                };
                std::hint::black_box(checksum);
                let request =
                    WriteRequest::new(&reply_target, 0, answer.clone()).immediate(done.immediate);
                if card.post_write(request).await.is_err() {
                    return;
                }
            }
        });
        Ok(Self {
            attn,
            inbox: inbox_descriptor,
            replies,
        })
    }

    async fn measure(&self, count: usize) -> BenchResult<Vec<Duration>> {
        let data = Bytes::from(vec![1u8; PING_BYTES]);
        let mut samples = Vec::with_capacity(count);
        for index in 0..count as u64 {
            let start = Instant::now();
            let request = WriteRequest::new(&self.inbox, 0, data.clone()).immediate(index);
            let _ticket = self.attn.post_write(request).await?;
            let done = self.replies.next_completion().await?;
            samples.push(start.elapsed());
            if done.immediate != index {
                return Err(format!("reply {} answered ping {index}", done.immediate).into());
            }
        }
        Ok(samples)
    }
}

/// Bytes per second streaming `count` layer-sized messages over a fresh TCP connection to a
/// receiver on the card node, until the receiver confirms the last byte.
async fn tcp_stream(card_node: &Handle, count: usize) -> BenchResult<f64> {
    let listener = card_node
        .spawn(async { TcpListener::bind("127.0.0.1:0").await })
        .await??;
    let addr = listener.local_addr()?;
    let receiver = card_node.spawn(async move {
        let (mut socket, _) = listener.accept().await?;
        socket.set_nodelay(true)?;
        let mut buffer = vec![0u8; LAYER_BYTES];
        for _ in 0..count {
            socket.read_exact(&mut buffer).await?;
        }
        socket.write_all(&[1]).await?;
        Ok::<_, std::io::Error>(())
    });
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let data = vec![3u8; LAYER_BYTES];
    let start = Instant::now();
    for _ in 0..count {
        stream.write_all(&data).await?;
    }
    let mut done = [0u8; 1];
    stream.read_exact(&mut done).await?;
    let elapsed = start.elapsed();
    receiver.await??;
    Ok((count * LAYER_BYTES) as f64 / elapsed.as_secs_f64())
}

/// Bytes per second streaming `count` layer-sized writes into one card region, until the
/// last one is acknowledged (the card drains completions as they come).
async fn jet_stream(
    attn: &QuicTransport,
    card: &QuicTransport,
    card_node: &Handle,
    count: usize,
) -> BenchResult<f64> {
    let inbox = card.register(RegionConfig::new(LAYER_BYTES).grant("attn"))?;
    let target = inbox.descriptor();
    let drain = card_node.spawn(async move {
        for _ in 0..count {
            inbox.next_completion().await?;
        }
        Ok::<_, jetstream::Error>(())
    });
    let data = Bytes::from(vec![3u8; LAYER_BYTES]);
    let start = Instant::now();
    let mut last = None;
    for index in 0..count as u64 {
        let request = WriteRequest::new(&target, 0, data.clone()).immediate(index);
        last = Some(attn.post_write(request).await?);
    }
    if let Some(ticket) = last {
        ticket.wait().await?;
    }
    let elapsed = start.elapsed();
    drain.await??;
    Ok((count * LAYER_BYTES) as f64 / elapsed.as_secs_f64())
}
