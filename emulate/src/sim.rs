//! The discrete-event run of an emulation: requests arrive on the workload's schedule, wait for
//! a concurrency slot as afd-loadtest's client does, are admitted and placed on the
//! least-loaded attention node as the router does, and each node's own [`Scheduler`] makes its
//! steps. A node runs a step at once (its tokens and routing are known right away) and the step
//! ends when its modeled duration has passed; only then are its tokens delivered and its
//! requests advanced, at that modeled instant. Nothing sleeps and nothing reads the wall
//! clock, so the same inputs give the same figures.

use std::collections::VecDeque;
use std::time::Duration;

use loadtest::record::RequestOutcome;
use router::scheduler::{NewRequest, RequestId, Scheduler, SchedulerOutput, SequenceParams};
use router::{RouterConfig, pick_node};
use step::clock::VirtualClock;
use step::{AttentionNode, StepError, StepOutput};

use crate::cost::{ModeledStep, StepModel};
use crate::error::{Error, Result};
use crate::faults::{CardFault, FaultState, StepFate};
use crate::record::{RoutingCounts, RoutingRecorder};

/// One request of the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct EmulatedRequest {
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    /// The prompt's length as the report counts it.
    pub prompt_len: usize,
    /// How to generate.
    pub params: SequenceParams,
    /// Arrival, seconds after the run starts.
    pub arrival: f64,
}

/// One step of one node, as the run made and timed it.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    /// The attention node.
    pub node: usize,
    /// When it started (modeled seconds since the run began).
    pub start: f64,
    /// Its modeled time and breakdown.
    pub modeled: ModeledStep,
    /// Tokens computed.
    pub tokens: usize,
    /// Sequences in it.
    pub sequences: usize,
    /// Prompt tokens among them (prefill chunks).
    pub prefill_tokens: usize,
    /// Whether the step failed (a card went down during it).
    pub failed: bool,
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SimOutcome {
    /// One outcome per request, in workload order, as afd-loadtest would have recorded it.
    pub outcomes: Vec<RequestOutcome>,
    /// Modeled seconds from the first request's send to the last request's end.
    pub duration: f64,
    /// Every step, in the order they started.
    pub steps: Vec<StepRecord>,
    /// The tokens each request got.
    pub token_ids: Vec<Vec<u32>>,
    /// The routing counts, when asked for.
    pub routing: Option<RoutingCounts>,
}

/// Settings of a run besides the nodes and the workload.
#[derive(Debug, Clone)]
pub struct SimSettings {
    /// The router's settings (each node's scheduler, admission).
    pub router: RouterConfig,
    /// At most this many requests in flight (afd-loadtest's `--max-concurrency`).
    pub max_concurrency: Option<usize>,
    /// A card that goes down during the run, if any.
    pub fault: Option<CardFault>,
    /// Count every step's routing in windows of this many steps.
    pub record_window: Option<u64>,
}

/// One attention node of the run.
struct NodeState {
    node: Box<dyn AttentionNode>,
    scheduler: Scheduler,
    /// Requests assigned and not finished.
    load: usize,
    busy: Option<InFlight>,
}

struct InFlight {
    ends: Duration,
    out: SchedulerOutput,
    result: std::result::Result<StepOutput, StepError>,
}

/// A request's progress.
#[derive(Debug, Clone, Default)]
struct Progress {
    sent: Option<Duration>,
    first: Option<Duration>,
    last: Duration,
    itl: Vec<f64>,
    tokens: Vec<u32>,
    error: Option<String>,
    /// Finished, failed or refused.
    done: bool,
    /// The node it was placed on.
    node: Option<usize>,
    /// Its slot and node load are given back.
    settled: bool,
}

/// Seconds of a duration.
fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Runs `requests` through `nodes` (each timed by `model`) and returns what a client saw.
pub fn run(
    mut nodes: Vec<Box<dyn AttentionNode>>,
    model: &StepModel,
    requests: &[EmulatedRequest],
    settings: &SimSettings,
    mut on_request_done: impl FnMut(usize),
) -> Result<SimOutcome> {
    let clock = VirtualClock::new();
    let mut states = Vec::with_capacity(nodes.len());
    for (i, mut node) in nodes.drain(..).enumerate() {
        node.record_routing(true);
        let kv = node.kv_capacity();
        let scheduler = Scheduler::new(
            settings.router.scheduler.clone(),
            kv.block_size,
            kv.num_blocks,
        )
        .map_err(|e| Error::Config(format!("attention node {i}: {e}")))?;
        states.push(NodeState {
            node,
            scheduler,
            load: 0,
            busy: None,
        });
    }
    if states.is_empty() {
        return Err(Error::Config(
            "an emulation needs at least one attention node".into(),
        ));
    }
    let arrivals: Vec<Duration> = requests
        .iter()
        .map(|r| Duration::from_secs_f64(r.arrival.max(0.0)))
        .collect();
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| (arrivals[i], i));
    let mut next_arrival = 0;
    let mut slot_queue: VecDeque<usize> = VecDeque::new();
    let mut in_flight = 0usize;
    let mut not_started = 0usize;
    let mut progress = vec![Progress::default(); requests.len()];
    // Request ids are the workload's indices + 1, so a node's sequence id says which request.
    let id_of = |i: usize| i as RequestId + 1;
    let index_of = |id: RequestId| (id - 1) as usize;
    let mut steps = Vec::new();
    let faults = settings.fault.clone().map(|f| FaultState::new(f, model));
    let mut recorder = match (settings.record_window, model.config().moe) {
        (Some(window), Some(m)) => {
            let moe = model.config().moe_layers();
            Some(RoutingRecorder::new(&moe, m.num_experts, m.top_k, window))
        }
        _ => None,
    };
    let mut t = Duration::ZERO;

    loop {
        clock.advance_to(t);
        // 1. Steps that end now: deliver their tokens.
        for (n, s) in states.iter_mut().enumerate() {
            if s.busy.as_ref().is_none_or(|b| b.ends > t) {
                continue;
            }
            let Some(done) = s.busy.take() else { continue };
            let ended = match done.result {
                Ok(result) => {
                    let (tokens, failed) =
                        s.scheduler
                            .update_from_output(&done.out, &result, clock.at(t));
                    for tok in tokens {
                        let i = index_of(tok.id);
                        let p = &mut progress[i];
                        match p.first {
                            None => p.first = Some(t),
                            Some(_) => p.itl.push(secs(t - p.last)),
                        }
                        p.last = t;
                        p.tokens.push(tok.token);
                        if tok.finish.is_some() {
                            p.done = true;
                        }
                    }
                    failed
                        .into_iter()
                        .map(|(id, why)| (id, why.to_string()))
                        .collect::<Vec<_>>()
                }
                Err(e) => {
                    let message = format!("attention node {n}: {e}");
                    s.scheduler
                        .fail_step(&done.out)
                        .into_iter()
                        .map(|id| (id, message.clone()))
                        .collect()
                }
            };
            for (id, why) in ended {
                let p = &mut progress[index_of(id)];
                p.error.get_or_insert(why);
                p.done = true;
            }
            let freed = s.scheduler.take_freed();
            if !freed.is_empty() {
                let _ = s.node.free(&freed);
            }
        }
        // Finished requests give their slots and their node's load back.
        settle(
            &mut progress,
            &mut states,
            &mut in_flight,
            &mut on_request_done,
        );

        // 2. Arrivals up to now wait for a concurrency slot.
        while next_arrival < order.len() && arrivals[order[next_arrival]] <= t {
            slot_queue.push_back(order[next_arrival]);
            next_arrival += 1;
        }
        // 3. Send what the concurrency cap lets through: admit, place, queue on the node.
        while let Some(&i) = slot_queue.front() {
            if settings.max_concurrency.is_some_and(|c| in_flight >= c) {
                break;
            }
            slot_queue.pop_front();
            let p = &mut progress[i];
            p.sent = Some(t);
            p.last = t;
            in_flight += 1;
            if not_started >= settings.router.max_waiting {
                p.error = Some(format!(
                    "HTTP 429: the waiting queue is full ({} requests waiting, limit {})",
                    not_started, settings.router.max_waiting
                ));
                p.done = true;
                continue;
            }
            let refused = faults.as_ref().is_some_and(|f| f.refuses(t));
            let serving: Vec<Option<usize>> = states
                .iter()
                .map(|s| (!refused).then_some(s.load))
                .collect();
            let Some(n) = pick_node(&serving) else {
                p.error = Some(format!(
                    "HTTP 503: no attention node can serve now: {}",
                    faults
                        .as_ref()
                        .map(FaultState::describe)
                        .unwrap_or_default()
                ));
                p.done = true;
                continue;
            };
            let r = &requests[i];
            let added = states[n].scheduler.add_request(NewRequest {
                id: id_of(i),
                prompt: r.prompt.clone(),
                params: r.params.clone(),
                arrival: clock.at(t),
            });
            match added {
                Ok(()) => {
                    states[n].load += 1;
                    not_started += 1;
                    p.node = Some(n);
                }
                Err(e) => {
                    p.error = Some(format!("HTTP 400: {e}"));
                    p.done = true;
                }
            }
        }
        settle(
            &mut progress,
            &mut states,
            &mut in_flight,
            &mut on_request_done,
        );

        // 4. Idle nodes with work start a step now.
        let mut started = Vec::new();
        for (n, s) in states.iter_mut().enumerate() {
            if s.busy.is_some() || !s.scheduler.has_work() {
                continue;
            }
            let out = s.scheduler.schedule(clock.at(t));
            not_started -= out.started.len().min(not_started);
            if !out.freed.is_empty() {
                let _ = s.node.free(&out.freed);
            }
            if out.is_empty() {
                continue;
            }
            // The emulated clock stands still during a step: the masks of constrained rows
            // (none in a generated workload) are computed before it, not beside it.
            for job in &out.mask_jobs {
                job.run();
            }
            let result = s.node.step(&out.batch);
            let routing = s.node.take_routing();
            if let (Some(rec), Some(r), Ok(_)) = (recorder.as_mut(), routing.as_ref(), &result) {
                rec.observe(r);
            }
            started.push((n, out, result, routing));
        }
        let busy_nodes = states.iter().filter(|s| s.busy.is_some()).count() + started.len();
        for (n, out, result, routing) in started {
            let placement = faults.as_ref().and_then(|f| f.placement_at(t));
            let mut modeled = model.time_with(
                &out.batch,
                routing.as_ref(),
                placement.or(model.placement()),
                busy_nodes,
            );
            // At least a nanosecond, so time always moves.
            let healthy_end = t + modeled.duration().max(Duration::from_nanos(1));
            let fate = faults
                .as_ref()
                .map_or(StepFate::Runs, |f| f.step_fate(t, healthy_end));
            let (result, ends) = match fate {
                StepFate::Runs => (result, healthy_end),
                StepFate::Fails { at } => {
                    let f = faults
                        .as_ref()
                        .map(FaultState::describe)
                        .unwrap_or_default();
                    let card = settings.fault.as_ref().map_or(0, |f| f.card);
                    (
                        Err(StepError::Card { card, message: f }),
                        at.max(t + Duration::from_nanos(1)),
                    )
                }
                StepFate::RunsAgain { from } => {
                    let live = faults.as_ref().and_then(|f| f.placement_at(from));
                    modeled = model.time_with(
                        &out.batch,
                        routing.as_ref(),
                        live.or(model.placement()),
                        busy_nodes,
                    );
                    (
                        result,
                        from + modeled.duration().max(Duration::from_nanos(1)),
                    )
                }
            };
            let tokens: usize = out.batch.entries.iter().map(|e| e.tokens.len()).sum();
            let prefill_tokens: usize = out
                .batch
                .entries
                .iter()
                .filter(|e| e.start < e.prompt_len)
                .map(|e| e.tokens.len().min(e.prompt_len - e.start))
                .sum();
            steps.push(StepRecord {
                node: n,
                start: secs(t),
                sequences: out.batch.entries.len(),
                tokens,
                prefill_tokens,
                failed: result.is_err(),
                modeled,
            });
            states[n].busy = Some(InFlight { ends, out, result });
        }

        // 5. The next event: a step's end, an arrival, or a fault.
        let next_end = states
            .iter()
            .filter_map(|s| s.busy.as_ref().map(|b| b.ends))
            .min();
        let next_in = (next_arrival < order.len()).then(|| arrivals[order[next_arrival]]);
        let next_fault = faults.as_ref().and_then(|f| f.next_change(t));
        let waiting_for_slot = !slot_queue.is_empty();
        let next = [next_end, next_in, next_fault].into_iter().flatten().min();
        match next {
            Some(n) => t = n.max(t),
            None => {
                if waiting_for_slot || states.iter().any(|s| s.scheduler.has_work()) {
                    // Work that no step can take and nothing left to free room: fail it.
                    for p in progress.iter_mut().filter(|p| !p.done) {
                        p.error = Some("the scheduler could not fit the request".into());
                        p.done = true;
                    }
                }
                break;
            }
        }
    }

    let start = progress
        .iter()
        .filter_map(|p| p.sent)
        .min()
        .unwrap_or(Duration::ZERO);
    let end = progress
        .iter()
        .map(|p| {
            if p.first.is_some() {
                p.last
            } else {
                p.sent.unwrap_or(Duration::ZERO)
            }
        })
        .max()
        .unwrap_or(Duration::ZERO);
    let outcomes = requests
        .iter()
        .zip(&progress)
        .enumerate()
        .map(|(i, (r, p))| outcome(r, p, arrivals[i]))
        .collect();
    Ok(SimOutcome {
        outcomes,
        duration: secs(end.saturating_sub(start)),
        steps,
        token_ids: progress.into_iter().map(|p| p.tokens).collect(),
        routing: recorder.map(|r| r.counts().clone()),
    })
}

/// Gives back the concurrency slots and node loads of requests that just finished.
fn settle(
    progress: &mut [Progress],
    states: &mut [NodeState],
    in_flight: &mut usize,
    on_request_done: &mut impl FnMut(usize),
) {
    for (i, p) in progress.iter_mut().enumerate() {
        if !p.done || p.settled || p.sent.is_none() {
            continue;
        }
        p.settled = true;
        *in_flight = in_flight.saturating_sub(1);
        if let Some(s) = p.node.and_then(|n| states.get_mut(n)) {
            s.load = s.load.saturating_sub(1);
        }
        on_request_done(i);
    }
}

/// What afd-loadtest would have recorded for a request.
fn outcome(r: &EmulatedRequest, p: &Progress, arrival: Duration) -> RequestOutcome {
    let sent = p.sent.unwrap_or(arrival);
    let base = RequestOutcome {
        client_prompt_len: r.prompt_len,
        start_time: secs(sent),
        queue_time: secs(sent.saturating_sub(arrival)),
        ..RequestOutcome::default()
    };
    match (&p.error, p.first) {
        (None, Some(first)) => RequestOutcome {
            success: true,
            ttft: secs(first - sent),
            itl: p.itl.clone(),
            latency: secs(p.last - sent),
            end_time: secs(p.last),
            usage_completion_tokens: Some(p.tokens.len() as u64),
            usage_prompt_tokens: Some(r.prompt.len() as u64),
            content_chunks: p.tokens.len(),
            ..base
        },
        (error, _) => RequestOutcome {
            success: false,
            error: error
                .clone()
                .unwrap_or_else(|| "the request never produced a token".into()),
            end_time: secs(p.last.max(sent)),
            ..base
        },
    }
}
