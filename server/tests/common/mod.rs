//! Shared helpers: a synthetic tiny GPT-OSS checkpoint (tokenizer and config only), a server
//! over fake attention nodes on 127.0.0.1:0, and SSE parsing.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use model::ModelTokenizer;
use model::sampling::SamplingParams;
use model::synth::{Preset, SynthOptions, synthesize};
use router::fake::{FakeNode, FakeNodeConfig};
use router::{Router, RouterConfig, SchedulerConfig};
use serde_json::Value;
use server::{DrainReport, Server, ServerConfig};
use step::Penalties;
use step::{AttentionNode, SampleRequest};

/// A tiny GPT-OSS checkpoint folder (config, tokenizer, chat template; no weights).
pub fn tiny_checkpoint() -> tempfile::TempDir {
    tiny_checkpoint_of(model::Family::GptOss)
}

/// A tiny checkpoint folder of `family` (config, tokenizer, chat template; no weights).
pub fn tiny_checkpoint_of(family: model::Family) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let options = SynthOptions {
        family,
        preset: Preset::Tiny,
        format: None,
        seed: 1,
        config_only: true,
    };
    synthesize(dir.path(), &options, &mut |_, _| {}).unwrap();
    dir
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub client: reqwest::Client,
    pub dir: tempfile::TempDir,
    pub node: FakeNodeConfig,
    pub tokenizer: ModelTokenizer,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    running: Option<tokio::task::JoinHandle<Result<DrainReport, server::Error>>>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

impl TestServer {
    /// Sends the stop signal (the server starts draining) and returns the running server,
    /// which resolves once it has drained and closed.
    pub fn stop(&mut self) -> tokio::task::JoinHandle<Result<DrainReport, server::Error>> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.running.take().expect("stopped once")
    }
}

pub fn router_config(max_num_seqs: usize, max_waiting: usize) -> RouterConfig {
    RouterConfig {
        scheduler: SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: 256,
            max_model_len: 256,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
        },
        max_waiting,
    }
}

pub async fn start_with(node: FakeNodeConfig, nodes: usize, router: RouterConfig) -> TestServer {
    let list: Vec<Box<dyn AttentionNode>> = (0..nodes)
        .map(|_| Box::new(FakeNode::new(node.clone())) as Box<dyn AttentionNode>)
        .collect();
    start_nodes(node, list, router).await
}

pub async fn start_nodes(
    node: FakeNodeConfig,
    nodes: Vec<Box<dyn AttentionNode>>,
    router: RouterConfig,
) -> TestServer {
    start_secured(node, nodes, router, None).await
}

/// A server whose `/v1/*` routes require `api_key` when given.
pub async fn start_secured(
    node: FakeNodeConfig,
    nodes: Vec<Box<dyn AttentionNode>>,
    router: RouterConfig,
    api_key: Option<&str>,
) -> TestServer {
    start_configured(node, nodes, router, |config| {
        config.api_key = api_key.map(server::ApiKey::new);
    })
    .await
}

/// A server over `nodes` with its settings changed by `configure`.
pub async fn start_configured(
    node: FakeNodeConfig,
    nodes: Vec<Box<dyn AttentionNode>>,
    router: RouterConfig,
    configure: impl FnOnce(&mut ServerConfig),
) -> TestServer {
    start_family(model::Family::GptOss, node, nodes, router, configure).await
}

/// [`start_configured`] over a tiny checkpoint of `family`.
pub async fn start_family(
    family: model::Family,
    node: FakeNodeConfig,
    nodes: Vec<Box<dyn AttentionNode>>,
    router: RouterConfig,
    configure: impl FnOnce(&mut ServerConfig),
) -> TestServer {
    let dir = tiny_checkpoint_of(family);
    let router = Router::start(router, nodes).unwrap();
    let mut config = ServerConfig {
        host: "127.0.0.1".into(),
        port: 0,
        model_dir: dir.path().to_path_buf(),
        served_model_name: Some("tiny".into()),
        ..Default::default()
    };
    configure(&mut config);
    let server = Server::bind(config, router, None).await.unwrap();
    let addr = server.local_addr();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run_until(async {
        let _ = rx.await;
    }));
    TestServer {
        addr,
        client: reqwest::Client::new(),
        tokenizer: ModelTokenizer::load(dir.path()).unwrap(),
        dir,
        node,
        shutdown: Some(tx),
        running: Some(running),
    }
}

pub async fn start() -> TestServer {
    start_with(FakeNodeConfig::default(), 1, router_config(64, 256)).await
}

/// A server whose node writes `output` (tokenized with the family's own tokenizer, special
/// tokens included), with auto tool choice on unless `auto` is false.
pub async fn scripted(family: model::Family, output: &str, auto: bool) -> TestServer {
    let dir = tiny_checkpoint_of(family);
    let tokenizer = ModelTokenizer::load(dir.path()).unwrap();
    let script = tokenizer.encode(output, false).unwrap();
    let node = FakeNodeConfig {
        script: Some(script),
        ..Default::default()
    };
    let nodes: Vec<Box<dyn AttentionNode>> = vec![Box::new(FakeNode::new(node.clone()))];
    // Byte-level tokens: prompts with tools are long.
    let mut router = router_config(8, 16);
    router.scheduler.max_model_len = 2048;
    start_family(family, node, nodes, router, |c| {
        c.enable_auto_tool_choice = auto;
    })
    .await
}

impl TestServer {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        post_to(&self.client, self.url(path), body).await
    }

    /// [`TestServer::post`] on a task of its own, so the request runs while the test goes on.
    pub fn spawn_post(&self, path: &str, body: Value) -> tokio::task::JoinHandle<(u16, Value)> {
        let client = self.client.clone();
        let url = self.url(path);
        tokio::spawn(async move { post_to(&client, url, body).await })
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self.client.get(self.url(path)).send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// The SSE events of a streaming request (the `data:` payloads, `[DONE]` included).
    pub async fn stream(&self, path: &str, body: Value) -> Vec<String> {
        let r = self
            .client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert!(
            r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        parse_sse(&r.text().await.unwrap())
    }

    /// Greedy tokens the fake node produces for `prompt` alone.
    pub fn expected(&self, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
        let sample = SampleRequest {
            params: SamplingParams::greedy(),
            penalties: Penalties::default(),
            logprobs: false,
            top_logprobs: 0,
            allowed: None,
        };
        let mut tokens = prompt.to_vec();
        for _ in 0..max_tokens {
            let t = FakeNode::next_token(&self.node, &tokens, prompt.len(), &sample);
            tokens.push(t);
        }
        tokens[prompt.len()..].to_vec()
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.tokenizer.encode(text, true).unwrap()
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap()
    }

    /// A metric's value (first sample whose line starts with `prefix`).
    pub async fn metric(&self, prefix: &str) -> Option<f64> {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    /// Polls a metric until `cond` holds (at most 10 s).
    pub async fn wait_metric(&self, prefix: &str, cond: impl Fn(f64) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(v) = self.metric(prefix).await
                && cond(v)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {prefix}: {:?}",
                self.metric(prefix).await
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

pub fn parse_sse(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| {
                    l.strip_prefix("data:")
                        .map(|d| d.strip_prefix(' ').unwrap_or(d))
                })
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// The JSON chunks of a stream (everything before `[DONE]`), checking `[DONE]` is last.
pub fn chunks(events: &[String]) -> Vec<Value> {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

pub fn checkpoint_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().to_path_buf()
}

pub fn script_node(text: &str, extra: &[u32]) -> FakeNodeConfig {
    let mut script: Vec<u32> = text.bytes().map(u32::from).collect();
    script.extend_from_slice(extra);
    FakeNodeConfig {
        script: Some(script),
        ..Default::default()
    }
}

pub fn shared<T>(v: T) -> Arc<T> {
    Arc::new(v)
}

/// Tokens a completions stream carried (it asked for `return_token_ids`), over all chunks: a
/// chunk holds several when the client fell behind.
pub fn streamed_tokens(chunks: &[Value]) -> usize {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["token_ids"].as_array())
        .map(Vec::len)
        .sum()
}

/// POSTs `body` as JSON: the status, and the body as JSON (or as a string when it is not).
async fn post_to(client: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = client.post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The error event a stream cut off by a shutdown ends with, checking `[DONE]` follows it and
/// that it says so.
pub fn cut_off_error(events: &[String]) -> Value {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], 503, "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("shutting down"), "{error}");
    error
}
