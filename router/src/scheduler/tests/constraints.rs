//! Structured outputs in the scheduler: a mask job for every step that samples a constrained
//! sequence (and none for its prefill chunks or for free sequences), each sampled token fed to
//! the grammar, and a token the grammar refuses failing only its own request.

use std::sync::{Arc, Mutex};

use step::{Constraint, SampledToken, StepOutput, TokenConstraint, TokenMask};

use super::*;

/// A grammar that allows `allowed` and records what it is fed.
struct Recording {
    allowed: Vec<u32>,
    accepted: Mutex<Vec<u32>>,
}

impl TokenConstraint for Recording {
    fn next_mask(&self) -> Result<TokenMask, String> {
        Ok(TokenMask::from_tokens(300, self.allowed.iter().copied()))
    }
    fn accept(&self, token: u32) -> Result<(), String> {
        if !self.allowed.contains(&token) {
            return Err(format!("token {token} is not allowed"));
        }
        self.accepted.lock().unwrap().push(token);
        Ok(())
    }
}

fn answer(out: &SchedulerOutput, token: impl Fn(RequestId) -> u32) -> StepOutput {
    StepOutput {
        sampled: out
            .batch
            .entries
            .iter()
            .filter(|e| e.sample.is_some())
            .map(|e| SampledToken {
                seq: e.seq,
                token: token(e.seq),
                logprob: 0.0,
                top_logprobs: Vec::new(),
            })
            .collect(),
        prompt_logprobs: Vec::new(),
    }
}

#[test]
fn constrained_rows_get_a_mask_job_and_their_tokens_go_to_the_grammar() {
    // A budget of 8 tokens: the 12-token prompt of request 1 takes two chunks.
    let mut sched = Scheduler::new(config(4, 8, 64), 4, 32).unwrap();
    let grammar = Arc::new(Recording {
        allowed: vec![5, 6],
        accepted: Mutex::new(Vec::new()),
    });
    let mut constrained = request(1, 12, 3);
    constrained.params.constraint = Some(Constraint(grammar.clone()));
    sched.add_request(constrained).unwrap();
    sched.add_request(request(2, 2, 3)).unwrap();

    let mut jobs_per_step = Vec::new();
    for step in 0..6 {
        let out = sched.schedule(Instant::now());
        if out.is_empty() {
            break;
        }
        for job in &out.mask_jobs {
            // The job's handle is the one the constrained row carries.
            let row = out.batch.entries.iter().find(|e| e.seq == 1).unwrap();
            assert_eq!(
                row.sample.as_ref().unwrap().allowed.as_ref(),
                Some(&job.allowed)
            );
            job.run();
            assert_eq!(
                job.allowed.wait(std::time::Duration::ZERO).unwrap().count(),
                2
            );
        }
        for e in &out.batch.entries {
            if let Some(s) = &e.sample {
                assert_eq!(s.allowed.is_some(), e.seq == 1, "step {step}: {e:?}");
            }
        }
        jobs_per_step.push(out.mask_jobs.len());
        let result = answer(&out, |seq| if seq == 1 { 5 + step as u32 % 2 } else { 7 });
        let (_, failed) = sched.update_from_output(&out, &result, Instant::now());
        assert!(failed.is_empty(), "{failed:?}");
    }
    // The first chunk samples nothing; then one job per sampled token, three in all.
    assert_eq!(jobs_per_step.first(), Some(&0));
    assert_eq!(jobs_per_step.iter().sum::<usize>(), 3, "{jobs_per_step:?}");
    assert_eq!(grammar.accepted.lock().unwrap().len(), 3);
}

#[test]
fn a_token_the_grammar_refuses_fails_only_its_request() {
    let mut sched = Scheduler::new(config(4, 64, 64), 4, 32).unwrap();
    let mut constrained = request(1, 3, 4);
    constrained.params.constraint = Some(Constraint(Arc::new(Recording {
        allowed: vec![5],
        accepted: Mutex::new(Vec::new()),
    })));
    sched.add_request(constrained).unwrap();
    sched.add_request(request(2, 3, 4)).unwrap();
    let out = sched.schedule(Instant::now());
    let (tokens, failed) = sched.update_from_output(&out, &answer(&out, |_| 9), Instant::now());
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].0, 1);
    assert!(matches!(&failed[0].1, SequenceFailure::Constraint(e) if e.contains("not allowed")));
    assert!(failed[0].1.to_string().contains("requested output format"));
    assert_eq!(tokens.iter().map(|t| t.id).collect::<Vec<_>>(), vec![2]);
    // The failed request is gone; the other goes on.
    let out = sched.schedule(Instant::now());
    assert_eq!(out.num_scheduled_tokens, vec![(2, 1)]);
}
