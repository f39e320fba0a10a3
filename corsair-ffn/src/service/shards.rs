//! The shard versions a card holds. A card starts with version 0; an expert move (EPLB) builds
//! the next version beside it while the old one keeps serving, every data-plane message names
//! the version it is for, so each attention node switches between two of its steps, and the
//! old version is freed once every node has moved ([`ShardTable::release_all_but`]).
//!
//! A version is a whole compiled program with its weights: the simulator rebuilds the card's
//! share rather than patching the experts that moved (what real cards would copy), so a move
//! briefly holds two programs in memory.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use model::kernels::ActivationDtype;
use model::weights::LoadOptions;
use model::{ModelConfig, ModelWeights};
use proto::control::LoadShardRequest;
use proto::data::WireDtype;

use super::{ServiceError, model_fingerprint};
use crate::assignment::CardAssignment;
use crate::card::{Card, CardOptions, LayerStats};
use crate::compiler::{CompileOptions, StoredFormats, compile};
use crate::executor::ExecOptions;
use crate::format::FormatChoice;
use crate::lm_head::CandidateOptions;
use crate::profile::HardwareProfile;

/// Traffic counters of a card, over every shard version it has held.
#[derive(Debug, Default)]
pub(crate) struct ShardCounters {
    pub messages: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub compute_seconds: Mutex<f64>,
}

/// One version of a card's share: its compiled program and weights.
pub(crate) struct Shard {
    pub version: u32,
    /// Shared with another version number whose assignment is the same (an alias).
    pub card: Arc<Mutex<Card>>,
    pub assignment_json: String,
    pub wire_dtype: WireDtype,
    pub counters: Arc<ShardCounters>,
    pub summary: String,
    /// Per layer, the rows one pass over an expert's weights is worth on this card
    /// ([`crate::perf::rows_per_weight_read`]), reported to every node that attaches.
    pub rows_per_weight_read: Vec<u32>,
    /// Per layer, the part of it a copy costs however many rows it computes
    /// ([`crate::perf::fixed_rows_per_copy`]), reported with it.
    pub fixed_rows_per_copy: Vec<u32>,
}

/// What every version of a card's shard shares: the settings of the request that loaded the
/// first one (a staged version changes only the assignment).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ShardSettings {
    pub model_dir: PathBuf,
    pub fingerprint: String,
    pub weight_format: String,
    pub wire_dtype: WireDtype,
    pub activations: ActivationDtype,
    pub max_tokens: usize,
    pub allow_spill: bool,
    pub candidates: usize,
}

impl ShardSettings {
    /// The settings `req` asks for.
    pub fn from_request(req: &LoadShardRequest) -> Result<Self, ServiceError> {
        Ok(ShardSettings {
            model_dir: PathBuf::from(&req.model_path),
            fingerprint: req.model_fingerprint.clone(),
            weight_format: req.weight_format.clone(),
            wire_dtype: req.wire_dtype.parse().map_err(ServiceError::Invalid)?,
            activations: activation_dtype(&req.activation_dtype)?,
            max_tokens: req.max_tokens as usize,
            allow_spill: req.allow_spill,
            candidates: req.lm_head_candidates as usize,
        })
    }

    /// Whether a node asking for `other` may share a card loaded with `self` (the model path
    /// may differ between machines; the fingerprint may not).
    pub fn compatible(&self, other: &ShardSettings) -> bool {
        self.fingerprint == other.fingerprint
            && self.weight_format == other.weight_format
            && self.wire_dtype == other.wire_dtype
            && self.activations == other.activations
    }
}

/// Per-layer statistics of versions already freed, so a card's counts survive a move.
#[derive(Debug, Default)]
struct Retired {
    layers: Vec<LayerStats>,
    lm_head: LayerStats,
}

fn add_layer(into: &mut LayerStats, from: &LayerStats) {
    into.calls += from.calls;
    into.tokens += from.tokens;
    into.expert_rows += from.expert_rows;
    into.wall_seconds += from.wall_seconds;
    into.modeled_seconds += from.modeled_seconds;
}

#[derive(Default)]
struct Inner {
    settings: Option<ShardSettings>,
    /// Ascending versions.
    versions: Vec<Arc<Shard>>,
    retired: Retired,
}

/// The shard versions one card holds, shared with its workers.
#[derive(Default)]
pub(crate) struct ShardTable {
    inner: Mutex<Inner>,
    counters: Arc<ShardCounters>,
}

impl ShardTable {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The counters every version adds to.
    pub fn counters(&self) -> &Arc<ShardCounters> {
        &self.counters
    }

    /// The settings of the loaded shard, if one is.
    pub fn settings(&self) -> Option<ShardSettings> {
        self.lock().settings.clone()
    }

    /// Version `version`, if held.
    pub fn get(&self, version: u32) -> Option<Arc<Shard>> {
        self.lock()
            .versions
            .iter()
            .find(|s| s.version == version)
            .cloned()
    }

    /// The versions held, ascending.
    pub fn versions(&self) -> Vec<u32> {
        self.lock().versions.iter().map(|s| s.version).collect()
    }

    /// Records the settings every version is built with (the first load's; later calls keep
    /// them).
    pub fn set_settings(&self, settings: ShardSettings) {
        self.lock().settings.get_or_insert(settings);
    }

    /// Adds `shard` (replacing a version of the same number).
    pub fn insert(&self, shard: Arc<Shard>) {
        let mut inner = self.lock();
        inner.versions.retain(|s| s.version != shard.version);
        inner.versions.push(shard);
        inner.versions.sort_by_key(|s| s.version);
    }

    /// The held version whose assignment is `assignment_json`, to serve another version number
    /// without building anything.
    pub fn same_assignment(&self, assignment_json: &str) -> Option<Arc<Shard>> {
        self.lock()
            .versions
            .iter()
            .rev()
            .find(|s| s.assignment_json == assignment_json)
            .cloned()
    }

    /// Frees every version but `keep` (a worker computing on one finishes first: it holds it);
    /// returns the versions held after.
    pub fn release_all_but(&self, keep: u32) -> Vec<u32> {
        let mut inner = self.lock();
        let (kept, freed): (Vec<_>, Vec<_>) = std::mem::take(&mut inner.versions)
            .into_iter()
            .partition(|s| s.version == keep);
        let mut counted: Vec<&Arc<Mutex<Card>>> = kept.iter().map(|k| &k.card).collect();
        for shard in &freed {
            // Versions that are aliases of one program (kept or freed) count it once.
            if counted.iter().any(|c| Arc::ptr_eq(c, &shard.card)) {
                continue;
            }
            counted.push(&shard.card);
            let stats = shard.card.lock().unwrap_or_else(|p| p.into_inner()).stats();
            let retired = &mut inner.retired;
            if retired.layers.len() < stats.layers.len() {
                retired
                    .layers
                    .resize_with(stats.layers.len(), LayerStats::default);
            }
            for (into, from) in retired.layers.iter_mut().zip(&stats.layers) {
                add_layer(into, from);
            }
            add_layer(&mut retired.lm_head, &stats.lm_head);
        }
        inner.versions = kept;
        inner.versions.iter().map(|s| s.version).collect()
    }

    /// The statistics of every version held and freed, with the newest's memory figures.
    pub fn stats(&self) -> Option<crate::card::CardStats> {
        let inner = self.lock();
        let newest = inner.versions.last()?;
        let mut total = newest
            .card
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stats();
        let mut seen = vec![Arc::as_ptr(&newest.card)];
        for shard in inner.versions.iter().rev().skip(1) {
            let ptr = Arc::as_ptr(&shard.card);
            if seen.contains(&ptr) {
                continue;
            }
            seen.push(ptr);
            let stats = shard.card.lock().unwrap_or_else(|p| p.into_inner()).stats();
            for (into, from) in total.layers.iter_mut().zip(&stats.layers) {
                add_layer(into, from);
            }
            add_layer(&mut total.lm_head, &stats.lm_head);
        }
        for (into, from) in total.layers.iter_mut().zip(&inner.retired.layers) {
            add_layer(into, from);
        }
        add_layer(&mut total.lm_head, &inner.retired.lm_head);
        Some(total)
    }
}

impl Shard {
    /// Version `version` serving the same program as `self` (the card's share did not change
    /// in a move).
    pub fn alias(&self, version: u32) -> Shard {
        Shard {
            version,
            card: Arc::clone(&self.card),
            assignment_json: self.assignment_json.clone(),
            wire_dtype: self.wire_dtype,
            counters: Arc::clone(&self.counters),
            summary: self.summary.clone(),
            rows_per_weight_read: self.rows_per_weight_read.clone(),
            fixed_rows_per_copy: self.fixed_rows_per_copy.clone(),
        }
    }
}

/// What a card is built with besides its share.
pub(crate) struct BuildContext<'a> {
    pub card_index: usize,
    pub profile: &'a HardwareProfile,
    pub exec: ExecOptions,
    pub counters: &'a Arc<ShardCounters>,
}

/// Compiles and loads version `version` of the card's share `assignment_json` with `settings`.
pub(crate) fn build_shard(
    cx: &BuildContext<'_>,
    settings: &ShardSettings,
    version: u32,
    assignment_json: &str,
) -> Result<Shard, ServiceError> {
    let me = cx.card_index;
    let dir: &Path = &settings.model_dir;
    let fingerprint = model_fingerprint(dir)?;
    if fingerprint != settings.fingerprint {
        return Err(ServiceError::Refused(format!(
            "card {me} found a different model at {} (fingerprint {fingerprint}, expected {}): \
             the path must name the same checkpoint on every machine",
            dir.display(),
            settings.fingerprint
        )));
    }
    let assignment: CardAssignment =
        serde_json::from_str(assignment_json).map_err(ServiceError::AssignmentJson)?;
    if assignment.card != me {
        return Err(ServiceError::Refused(format!(
            "card {me} was sent the shard of card {}",
            assignment.card
        )));
    }
    let config_path = dir.join("config.json");
    let config = ModelConfig::from_file(&config_path).map_err(crate::Error::from)?;
    let config_text =
        std::fs::read_to_string(&config_path).map_err(|source| ServiceError::ReadConfig {
            path: config_path.clone(),
            source,
        })?;
    let stored = StoredFormats::from_config_json(&config_text, &config)?;
    let format: FormatChoice = settings
        .weight_format
        .parse()
        .map_err(ServiceError::Invalid)?;
    let options = CompileOptions {
        format,
        max_tokens: settings.max_tokens,
        allow_spill: settings.allow_spill,
        candidates: settings.candidates,
        activations: settings.activations,
        ..CompileOptions::default()
    };
    let compiled = compile(&config, &stored, &assignment, &options, cx.profile)?;
    let s = crate::report::summarize(&compiled);
    let summary = format!(
        "card {}/{}: {}; SRAM {} of {}; {} tiles on {} cores; {} spilled to LPDDR",
        s.card,
        s.cards,
        s.share,
        crate::report::human_bytes(s.sram_used),
        crate::report::human_bytes(s.sram_capacity),
        s.tiles,
        s.weight_cores,
        crate::report::human_bytes(s.spilled_bytes)
    );
    let rows_per_weight_read = crate::perf::rows_per_weight_read(&compiled.program);
    let fixed_rows_per_copy = crate::perf::fixed_rows_per_copy(&compiled.program);
    let weights = ModelWeights::load_with(
        dir,
        &LoadOptions {
            experts: assignment.expert_filter(),
            ..LoadOptions::default()
        },
    )
    .map_err(crate::Error::from)?;
    let card = Card::new(
        compiled.program,
        &weights,
        CardOptions {
            exec: cx.exec,
            candidates: CandidateOptions {
                candidates: settings.candidates,
            },
        },
    )?;
    Ok(Shard {
        version,
        card: Arc::new(Mutex::new(card)),
        assignment_json: assignment_json.to_owned(),
        wire_dtype: settings.wire_dtype,
        counters: Arc::clone(cx.counters),
        summary,
        rows_per_weight_read,
        fixed_rows_per_copy,
    })
}

/// The request's activation dtype (empty: f32, what an attention node that names none means).
pub(crate) fn activation_dtype(text: &str) -> Result<ActivationDtype, ServiceError> {
    if text.is_empty() {
        return Ok(ActivationDtype::F32);
    }
    text.parse().map_err(ServiceError::Invalid)
}

/// Time a closure and add it to the card's compute seconds.
pub(crate) fn timed<R>(shard: &Shard, f: impl FnOnce() -> R) -> R {
    let t = Instant::now();
    let r = f();
    *shard
        .counters
        .compute_seconds
        .lock()
        .unwrap_or_else(|p| p.into_inner()) += t.elapsed().as_secs_f64();
    r
}

/// How many bytes and messages a card has moved.
pub(crate) fn count_message(counters: &ShardCounters, bytes: usize) {
    counters.messages.fetch_add(1, Ordering::Relaxed);
    counters.bytes_in.fetch_add(bytes as u64, Ordering::Relaxed);
}
