//! One measured run: resolve the model, build the workload, warm up, send requests on their
//! arrival schedule under the concurrency cap, then compute the metrics. This is the async
//! shell around the pure parts (`prompts`, `arrival`, `record`, `metrics`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::sync::Semaphore;

use crate::arrival::arrival_offsets;
use crate::client::{ApiClient, first_model};
use crate::config::{BenchmarkConfig, PromptSource};
use crate::connection::ConnectionPool;
use crate::error::Error;
use crate::metrics::calculate_metrics;
use crate::prompts::{RequestSpec, build_requests};
use crate::record::RequestOutcome;
use crate::result::{BenchmarkResult, WorkloadInfo, utc_timestamp};

/// The model to send: `config.model`, else the first model the server lists.
pub async fn resolve_model(config: &BenchmarkConfig) -> Result<String, Error> {
    if let Some(model) = &config.model {
        return Ok(model.clone());
    }
    config.validate()?;
    let pool = ConnectionPool::new(&config.base_url, config.request_timeout)?;
    first_model(&pool, config.api_key.as_deref()).await
}

/// Runs one benchmark against `config.base_url` and returns its result.
///
/// Failed requests do not make this fail: they are counted in the result with their reasons.
/// It fails when the settings are invalid, the model cannot be looked up, the prompt file
/// cannot be read, or every warm-up request fails.
pub async fn run_benchmark(config: &BenchmarkConfig) -> Result<BenchmarkResult, Error> {
    config.validate()?;
    let pool = ConnectionPool::new(&config.base_url, config.request_timeout)?;
    let base_url = config.base_url.trim_end_matches('/').to_string();
    let model = match &config.model {
        Some(m) => m.clone(),
        None => first_model(&pool, config.api_key.as_deref()).await?,
    };
    let api_path = format!("{}{}", pool.base_path(), config.endpoint.path());
    let client = Arc::new(ApiClient {
        api_url: pool.url(&api_path),
        api_path,
        pool,
        endpoint: config.endpoint,
        model: model.clone(),
        api_key: config.api_key.clone(),
        ignore_eos: config.ignore_eos,
        temperature: config.temperature,
    });

    let mut rng = StdRng::seed_from_u64(config.seed);
    let specs = build_requests(config, &mut rng)?;
    let offsets = arrival_offsets(
        specs.len(),
        config.request_rate,
        config.burstiness,
        &mut rng,
    );

    if let Some(first) = specs.first() {
        warm_up(&client, first, config).await?;
    }
    let date = utc_timestamp();
    let (outcomes, duration) = measure(&client, specs, &offsets, config).await;

    let metrics = calculate_metrics(&outcomes, duration, &config.percentiles, &config.goodput);
    let backend = config.endpoint.vllm_backend_name().to_string();
    let mut result = BenchmarkResult {
        date,
        endpoint_type: backend.clone(),
        backend: backend.clone(),
        label: config.label.clone().unwrap_or(backend),
        model_id: model.clone(),
        tokenizer_id: model,
        num_prompts: config.num_prompts,
        request_rate: config.request_rate,
        burstiness: config.burstiness,
        max_concurrency: config.max_concurrency,
        duration,
        input_lens: outcomes.iter().map(RequestOutcome::prompt_len).collect(),
        ttfts: outcomes.iter().map(|o| o.ttft).collect(),
        itls: outcomes.iter().map(|o| o.itl.clone()).collect(),
        latencies: outcomes.iter().map(|o| o.latency).collect(),
        start_times: outcomes.iter().map(|o| o.start_time).collect(),
        queue_times: outcomes.iter().map(|o| o.queue_time).collect(),
        generated_texts: outcomes.iter().map(|o| o.generated_text.clone()).collect(),
        errors: outcomes.iter().map(|o| o.error.clone()).collect(),
        base_url,
        num_requests_sent: outcomes.len(),
        retried_requests: outcomes.iter().filter(|o| o.retried).count(),
        workload: WorkloadInfo {
            prompt_source: match config.effective_prompt_source() {
                PromptSource::TokenIds | PromptSource::Auto => "token-ids".into(),
                PromptSource::RandomWords => "random-words".into(),
                PromptSource::File(path) => format!("file:{}", path.display()),
            },
            input_len: config.prompts.input_len,
            output_len: config.prompts.output_len,
            range_ratio: config.prompts.range_ratio,
            ignore_eos: config.ignore_eos,
            seed: config.seed,
            num_warmups: config.num_warmups,
            goodput: config.goodput.iter().map(ToString::to_string).collect(),
        },
        ..BenchmarkResult::default()
    };
    result.fill_metrics(&metrics);
    Ok(result)
}

/// Sends `config.num_warmups` copies of the first request; an error if all of them fail.
async fn warm_up(
    client: &Arc<ApiClient>,
    spec: &RequestSpec,
    config: &BenchmarkConfig,
) -> Result<(), Error> {
    if config.num_warmups == 0 {
        return Ok(());
    }
    let limit = Arc::new(Semaphore::new(
        config.max_concurrency.unwrap_or(config.num_warmups).max(1),
    ));
    let clock = Instant::now();
    let mut tasks = Vec::with_capacity(config.num_warmups);
    for _ in 0..config.num_warmups {
        let client = Arc::clone(client);
        let spec = spec.clone();
        let limit = Arc::clone(&limit);
        tasks.push(tokio::spawn(async move {
            let _slot = limit.acquire_owned().await.ok();
            client.send(&spec, clock, 0.0).await
        }));
    }
    let mut first_failure = None;
    let mut any_success = false;
    for task in tasks {
        match task.await {
            Ok(o) if o.success => any_success = true,
            Ok(o) => {
                first_failure.get_or_insert(o.error);
            }
            Err(e) => {
                first_failure.get_or_insert(format!("the warm-up task stopped: {e}"));
            }
        }
    }
    if any_success {
        return Ok(());
    }
    Err(Error::WarmupFailed {
        url: client.api_url.clone(),
        model: client.model.clone(),
        attempted: config.num_warmups,
        reason: first_failure.unwrap_or_default(),
    })
}

/// The measured run: outcomes in request order (requests not sent because of the duration
/// limit are left out) and the run's duration in seconds.
async fn measure(
    client: &Arc<ApiClient>,
    specs: Vec<RequestSpec>,
    offsets: &[f64],
    config: &BenchmarkConfig,
) -> (Vec<RequestOutcome>, f64) {
    let slots = config.max_concurrency.map(|c| Arc::new(Semaphore::new(c)));
    let progress = progress_bar(config, specs.len());
    let failures = Arc::new(AtomicUsize::new(0));
    let limit_s = config.max_duration.map(|d| d.as_secs_f64());
    let clock = Instant::now();
    let tokio_clock = tokio::time::Instant::from_std(clock);
    let mut tasks = Vec::with_capacity(specs.len());
    for (spec, &offset) in specs.into_iter().zip(offsets) {
        if limit_s.is_some_and(|limit| offset >= limit) {
            break;
        }
        tokio::time::sleep_until(tokio_clock + Duration::from_secs_f64(offset)).await;
        let client = Arc::clone(client);
        let slots = slots.clone();
        let progress = progress.clone();
        let failures = Arc::clone(&failures);
        tasks.push(tokio::spawn(async move {
            let arrived_at = clock.elapsed().as_secs_f64();
            let _slot = match slots {
                Some(s) => s.acquire_owned().await.ok(),
                None => None,
            };
            if limit_s.is_some_and(|limit| clock.elapsed().as_secs_f64() >= limit) {
                return None;
            }
            let outcome = client.send(&spec, clock, arrived_at).await;
            if !outcome.success {
                let n = failures.fetch_add(1, Ordering::Relaxed) + 1;
                progress.set_message(format!("{n} failed"));
            }
            progress.inc(1);
            Some(outcome)
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for task in tasks {
        match task.await {
            Ok(Some(outcome)) => outcomes.push(outcome),
            Ok(None) => {}
            Err(e) => {
                let t = clock.elapsed().as_secs_f64();
                outcomes.push(RequestOutcome::failed(
                    t,
                    t,
                    0,
                    format!("the request task stopped: {e}"),
                ));
            }
        }
    }
    let duration = clock.elapsed().as_secs_f64();
    progress.finish_and_clear();
    (outcomes, duration)
}

fn progress_bar(config: &BenchmarkConfig, total: usize) -> ProgressBar {
    if !config.show_progress {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests ({per_sec}) {msg}",
    ) {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}
