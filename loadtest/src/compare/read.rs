//! Loading result files for a comparison: afd-loadtest's or `vllm bench serve`'s per-run JSON
//! (only the summary fields are read, so any tool writing vLLM's field names works), a sweep's
//! `-summary.json` (its points' files are loaded), or a folder of per-run files.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize;

use super::{MeasuredPoint, PointMetrics};
use crate::error::Error;

/// One command-line input: `[LABEL=]PATH`, a result file, a sweep summary or a folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputSpec {
    /// The variant's name for every run under `path`; `None` uses each result's `label`.
    pub label: Option<String>,
    /// A file or a folder.
    pub path: PathBuf,
}

impl FromStr for InputSpec {
    type Err = String;
    /// `mono=results/mono` names the variant; a bare path takes names from the results.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (label, path) = match s.split_once('=') {
            // A '/' before the '=' means the '=' is part of a path.
            Some((label, path)) if !label.contains('/') && !label.is_empty() => {
                (Some(label.to_string()), path)
            }
            _ => (None, s),
        };
        if path.is_empty() {
            return Err(format!(
                "'{s}' names no file: write LABEL=PATH or PATH (a result JSON or a folder)"
            ));
        }
        Ok(InputSpec {
            label,
            path: PathBuf::from(path),
        })
    }
}

/// The fields of a result file a comparison reads; missing optional ones are `None`.
#[derive(Debug, Deserialize)]
struct ResultFields {
    label: Option<String>,
    backend: Option<String>,
    max_concurrency: Option<usize>,
    completed: Option<usize>,
    failed: Option<usize>,
    output_throughput: f64,
    median_tpot_ms: f64,
    p99_tpot_ms: Option<f64>,
    median_ttft_ms: f64,
    p99_ttft_ms: Option<f64>,
}

/// A sweep summary: its points name their result files, relative to the summary.
#[derive(Debug, Deserialize)]
struct SweepSummaryFields {
    sweep_parameter: String,
    points: Vec<SummaryPointFields>,
}

#[derive(Debug, Deserialize)]
struct SummaryPointFields {
    result_file: Option<String>,
}

fn input_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::CompareInput {
        path: path.to_path_buf(),
        reason: reason.into(),
        cause: None,
    }
}

/// An input error caused by another crate's failure; `reason` says what it said, in context.
fn input_failure(
    path: &Path,
    reason: String,
    cause: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::CompareInput {
        path: path.to_path_buf(),
        reason,
        cause: Some(Box::new(cause)),
    }
}

fn is_summary(value: &serde_json::Value) -> bool {
    value.get("sweep_parameter").is_some() && value.get("points").is_some()
}

fn is_result(value: &serde_json::Value) -> bool {
    value.get("output_throughput").is_some() && value.get("median_tpot_ms").is_some()
}

/// Parses one per-run result. `label` overrides the file's own label.
pub(crate) fn parse_result(
    text: &str,
    label: Option<&str>,
    path: &Path,
) -> Result<MeasuredPoint, Error> {
    let fields: ResultFields = serde_json::from_str(text).map_err(|e| {
        input_failure(
            path,
            format!(
                "not a result file ({e}); it needs vLLM's summary fields such as \
                 output_throughput and median_tpot_ms"
            ),
            e,
        )
    })?;
    let concurrency = fields.max_concurrency.ok_or_else(|| {
        input_error(
            path,
            "max_concurrency is null: comparisons group runs by concurrency, so measure with \
             --max-concurrency C or --sweep concurrency=...",
        )
    })?;
    let variant = label
        .map(str::to_string)
        .or(fields.label.filter(|l| !l.is_empty()))
        .or(fields.backend)
        .unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
    Ok(MeasuredPoint {
        variant,
        concurrency,
        metrics: PointMetrics {
            median_tpot_ms: fields.median_tpot_ms,
            p99_tpot_ms: fields.p99_tpot_ms,
            median_ttft_ms: fields.median_ttft_ms,
            p99_ttft_ms: fields.p99_ttft_ms,
            output_throughput: fields.output_throughput,
            completed: fields.completed.unwrap_or(0),
            failed: fields.failed.unwrap_or(0),
        },
        source: path.to_path_buf(),
    })
}

fn read_json(path: &Path) -> Result<(String, serde_json::Value), Error> {
    let text = std::fs::read_to_string(path).map_err(|e| input_failure(path, e.to_string(), e))?;
    let value = serde_json::from_str(&text)
        .map_err(|e| input_failure(path, format!("not valid JSON: {e}"), e))?;
    Ok((text, value))
}

/// The runs of a sweep summary, from the files its points name.
fn read_summary(text: &str, label: Option<&str>, path: &Path) -> Result<Vec<MeasuredPoint>, Error> {
    let summary: SweepSummaryFields =
        serde_json::from_str(text).map_err(|e| input_failure(path, e.to_string(), e))?;
    if summary.sweep_parameter != "max_concurrency" {
        return Err(input_error(
            path,
            format!(
                "this sweep varied {}; comparisons group runs by concurrency (--sweep concurrency=...)",
                summary.sweep_parameter
            ),
        ));
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut points = Vec::new();
    for point in summary.points {
        let file = point.result_file.ok_or_else(|| {
            input_error(
                path,
                "a point names no result_file; pass the per-point files instead",
            )
        })?;
        let point_path = dir.join(file);
        let (text, _) = read_json(&point_path)?;
        points.push(parse_result(&text, label, &point_path)?);
    }
    Ok(points)
}

/// Every run under one input: a result file, a sweep summary, or a folder whose per-run result
/// files (`*.json`, by name) are read; in a folder, summaries and other JSON files are skipped.
pub fn read_input(spec: &InputSpec) -> Result<Vec<MeasuredPoint>, Error> {
    let label = spec.label.as_deref();
    let path = &spec.path;
    if path.is_dir() {
        let entries = std::fs::read_dir(path).map_err(|e| input_failure(path, e.to_string(), e))?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        let mut points = Vec::new();
        for file in files {
            let (text, value) = read_json(&file)?;
            if is_result(&value) && !is_summary(&value) {
                points.push(parse_result(&text, label, &file)?);
            }
        }
        if points.is_empty() {
            return Err(input_error(
                path,
                "the folder holds no result files (JSON with output_throughput and median_tpot_ms)",
            ));
        }
        return Ok(points);
    }
    let (text, value) = read_json(path)?;
    if is_summary(&value) {
        read_summary(&text, label, path)
    } else {
        Ok(vec![parse_result(&text, label, path)?])
    }
}

/// Every run under every input, in the order given.
pub fn read_inputs(specs: &[InputSpec]) -> Result<Vec<MeasuredPoint>, Error> {
    let mut points = Vec::new();
    for spec in specs {
        points.extend(read_input(spec)?);
    }
    Ok(points)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::Comparison;

    fn result_json(label: &str, concurrency: usize, tpot: f64, tps: f64) -> String {
        serde_json::json!({
            "label": label,
            "backend": "openai",
            "max_concurrency": concurrency,
            "completed": 8,
            "failed": 1,
            "output_throughput": tps,
            "median_tpot_ms": tpot,
            "mean_tpot_ms": tpot + 1.0,
            "p99_tpot_ms": tpot * 1.5,
            "median_ttft_ms": 100.0,
            "p99_ttft_ms": 150.0,
        })
        .to_string()
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn input_specs_parse() {
        let s: InputSpec = "mono=results/mono".parse().unwrap();
        assert_eq!(s.label.as_deref(), Some("mono"));
        assert_eq!(s.path, PathBuf::from("results/mono"));
        let s: InputSpec = "results/a=b.json".parse().unwrap();
        assert_eq!(s.label, None);
        assert_eq!(s.path, PathBuf::from("results/a=b.json"));
        assert!("mono=".parse::<InputSpec>().is_err());
    }

    #[test]
    fn files_and_folders_read_into_a_comparison_with_ratios() {
        let dir = tempfile::tempdir().unwrap();
        let mono = dir.path().join("mono");
        let afd = dir.path().join("afd");
        std::fs::create_dir_all(&mono).unwrap();
        std::fs::create_dir_all(&afd).unwrap();
        // Two rounds of mono at concurrency 1, one at 4; a summary and a foreign JSON to skip.
        write(&mono, "r1-c1.json", &result_json("openai", 1, 10.0, 100.0));
        write(&mono, "r2-c1.json", &result_json("openai", 1, 30.0, 60.0));
        write(&mono, "r1-c4.json", &result_json("openai", 4, 20.0, 200.0));
        write(
            &mono,
            "x-summary.json",
            r#"{"sweep_parameter":"max_concurrency","points":[]}"#,
        );
        write(&mono, "metrics.json", r#"{"cards": 2}"#);
        write(&afd, "c1.json", &result_json("afd-2cards", 1, 40.0, 40.0));
        write(&afd, "c4.json", &result_json("afd-2cards", 4, 30.0, 300.0));
        let specs = vec![
            format!("mono={}", mono.display()).parse().unwrap(),
            InputSpec {
                label: None,
                path: afd.clone(),
            },
        ];
        let points = read_inputs(&specs).unwrap();
        assert_eq!(points.len(), 5);
        let c = Comparison::new(&points, None).unwrap();
        assert_eq!(c.baseline, "mono");
        let mono1 = c.variant("mono").unwrap().at(1).unwrap();
        assert_eq!(mono1.runs, 2);
        assert_eq!(mono1.median_tpot_ms, 20.0);
        assert_eq!(mono1.p99_tpot_ms, Some(30.0));
        assert_eq!(mono1.failed, 2);
        let afd = c.variant("afd-2cards").unwrap();
        assert_eq!(afd.at(1).unwrap().tpot_ratio, Some(2.0));
        assert_eq!(afd.at(1).unwrap().throughput_ratio, Some(0.5));
        assert_eq!(afd.at(4).unwrap().throughput_ratio, Some(1.5));
        assert_eq!(afd.at(4).unwrap().tpot_ratio, Some(1.5));
    }

    #[test]
    fn a_summary_loads_its_points() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "p1.json", &result_json("hf", 1, 5.0, 200.0));
        write(dir.path(), "p4.json", &result_json("hf", 4, 6.0, 600.0));
        let summary = write(
            dir.path(),
            "s-summary.json",
            r#"{"sweep_parameter":"max_concurrency","points":[{"result_file":"p1.json"},{"result_file":"p4.json"}]}"#,
        );
        let points = read_input(&InputSpec {
            label: Some("peer".into()),
            path: summary,
        })
        .unwrap();
        assert_eq!(points.len(), 2);
        assert!(points.iter().all(|p| p.variant == "peer"));
        assert_eq!(points[1].concurrency, 4);
        assert_eq!(points[1].metrics.output_throughput, 600.0);
    }

    #[test]
    fn bad_inputs_say_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let no_conc = write(
            dir.path(),
            "rate.json",
            r#"{"max_concurrency":null,"output_throughput":1,"median_tpot_ms":1,"median_ttft_ms":1}"#,
        );
        let err = read_input(&InputSpec {
            label: None,
            path: no_conc,
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("max_concurrency") && err.contains("rate.json"),
            "{err}"
        );

        let not_result = write(dir.path(), "other.json", r#"{"cards": 2}"#);
        let err = read_input(&InputSpec {
            label: None,
            path: not_result,
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("output_throughput"), "{err}");

        let empty = dir.path().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let err = read_input(&InputSpec {
            label: None,
            path: empty,
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("no result files"), "{err}");

        let err = read_input(&InputSpec {
            label: None,
            path: dir.path().join("missing.json"),
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("missing.json"), "{err}");
    }
}
