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
use crate::client::{ApiClient, TIME_DILATION_HEADER, first_model, server_time_dilation};
use crate::config::{BenchmarkConfig, PromptSource};
use crate::connection::ConnectionPool;
use crate::error::Error;
use crate::metrics::calculate_metrics;
use crate::prompts::{RequestSpec, build_requests};
use crate::record::RequestOutcome;
use crate::result::{BenchmarkResult, TimeBase, WorkloadInfo, utc_timestamp};

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

    let (specs, offsets) = workload(config)?;
    // A server on a dilated clock says so on every answer (a server measuring its dilation
    // settles on its first steps, which the warm-up covers).
    let dilated = match specs.first() {
        Some(first) => warm_up(&client, first, config).await?,
        None => false,
    };
    // Asked once more after the warm-up, and only of a server that said it is dilated.
    let warmed = if dilated {
        server_time_dilation(&client.pool, config.api_key.as_deref()).await
    } else {
        None
    };
    let unsettled = warmed.is_some_and(|(_, settled)| !settled);
    let warmed = warmed.map(|(k, _)| k);
    // Against a dilated server the arrivals are dilated too, so the offered load is the
    // configured one on the server's modeled clock.
    let offsets: Vec<f64> = match warmed {
        Some(k) => offsets.iter().map(|o| o * k).collect(),
        None => offsets,
    };
    let date = utc_timestamp();
    let (mut outcomes, mut duration) = measure(&client, specs, &offsets, config).await;
    let said: Vec<f64> = outcomes.iter().filter_map(|o| o.time_dilation).collect();
    let dilation = warmed.or_else(|| said.first().copied());
    if let Some(k) = dilation {
        undilate(&mut outcomes, &mut duration, k);
    }
    let mut result = benchmark_result(config, &model, base_url, &outcomes, duration, date);
    result.time_base = dilation.map(|k| {
        let mut caveats = String::new();
        if said.iter().any(|&s| s != k) {
            caveats += " (WARNING: its answers did not all say the same dilation: the times \
                        mix several; warm up longer or fix --time-dilation)";
        }
        if unsettled {
            caveats += " (WARNING: the server was still measuring its dilation after the \
                        warm-up: warm up longer, or fix --time-dilation)";
        }
        if warmed.is_none() && config.request_rate.is_finite() {
            caveats += " (without a warm-up the dilation was not known before the run, so the \
                        arrivals were not spaced by it: the offered rate was k times higher)";
        }
        TimeBase {
            clock: "dilated".into(),
            dilation: k,
            note: format!(
                "the server runs a modeled clock {k} times slower than the wall (its \
                 {TIME_DILATION_HEADER} header); every time here is divided by {k}{caveats}"
            ),
        }
    });
    Ok(result)
}

/// Divides every time of a run against a server dilated `k` times by `k`.
fn undilate(outcomes: &mut [RequestOutcome], duration: &mut f64, k: f64) {
    *duration /= k;
    for o in outcomes {
        o.ttft /= k;
        o.latency /= k;
        o.start_time /= k;
        o.end_time /= k;
        o.queue_time /= k;
        for gap in &mut o.itl {
            *gap /= k;
        }
    }
}

/// The workload of `config`: every request (prompt and output length) and its arrival offset
/// in seconds, drawn from `config.seed` before anything is sent (as vLLM does), so every runner
/// (this client, an emulation) gets the same requests at the same times for the same seed.
pub fn workload(config: &BenchmarkConfig) -> Result<(Vec<RequestSpec>, Vec<f64>), Error> {
    let mut rng = StdRng::seed_from_u64(config.seed);
    let specs = build_requests(config, &mut rng)?;
    let offsets = arrival_offsets(
        specs.len(),
        config.request_rate,
        config.burstiness,
        &mut rng,
    );
    Ok((specs, offsets))
}

/// The result of a run of `config` that measured `outcomes` (one per request sent, in
/// workload order) over `duration` seconds: the metrics and every per-request array, with
/// vLLM's field names. Shared by every runner (this client, and afd's emulation of a
/// deployment), so a figure means the same wherever it came from.
pub fn benchmark_result(
    config: &BenchmarkConfig,
    model: &str,
    base_url: String,
    outcomes: &[RequestOutcome],
    duration: f64,
    date: String,
) -> BenchmarkResult {
    let metrics = calculate_metrics(outcomes, duration, &config.percentiles, &config.goodput);
    let backend = config.endpoint.vllm_backend_name().to_string();
    let mut result = BenchmarkResult {
        date,
        endpoint_type: backend.clone(),
        backend: backend.clone(),
        label: config.label.clone().unwrap_or(backend),
        model_id: model.to_string(),
        tokenizer_id: model.to_string(),
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
            prefix_len: config.prompts.prefix_len,
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
    result
}

/// Sends `config.num_warmups` copies of the first request; an error if all of them fail.
/// Whether the server said it runs on a dilated clock.
async fn warm_up(
    client: &Arc<ApiClient>,
    spec: &RequestSpec,
    config: &BenchmarkConfig,
) -> Result<bool, Error> {
    if config.num_warmups == 0 {
        return Ok(false);
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
    let mut dilated = false;
    for task in tasks {
        match task.await {
            Ok(o) if o.success => {
                any_success = true;
                dilated |= o.time_dilation.is_some();
            }
            Ok(o) => {
                first_failure.get_or_insert(o.error);
            }
            Err(e) => {
                first_failure.get_or_insert(format!("the warm-up task stopped: {e}"));
            }
        }
    }
    if any_success {
        return Ok(dilated);
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
