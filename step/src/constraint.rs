//! Constrained decoding across the step API: the tokens a sequence may sample next.
//!
//! A request with structured output (a JSON schema, a regex, a grammar) carries a
//! [`TokenConstraint`]: the grammar's state, which says which tokens may come next and takes the
//! token that was sampled. The router asks it for the next step's mask off its scheduling
//! thread, while the node computes the step: each sampling row carries an [`AllowedTokens`]
//! handle the router fills in and the node waits on only when it samples, so a mask costs a
//! step nothing unless it takes longer than the step's forward pass.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// A set of token ids in `0..len`, as bits.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenMask {
    bits: Vec<u64>,
    len: usize,
}

impl TokenMask {
    /// No token of `0..len` allowed.
    pub fn none(len: usize) -> Self {
        TokenMask {
            bits: vec![0; len.div_ceil(64)],
            len,
        }
    }

    /// Every token of `0..len` allowed.
    pub fn all(len: usize) -> Self {
        let mut m = TokenMask::none(len);
        for t in 0..len {
            m.allow(t as u32);
        }
        m
    }

    /// The set of `tokens` (ids at or past `len` are left out).
    pub fn from_tokens(len: usize, tokens: impl IntoIterator<Item = u32>) -> Self {
        let mut m = TokenMask::none(len);
        for t in tokens {
            m.allow(t);
        }
        m
    }

    /// The set whose bits are `words` (bit `t % 64` of word `t / 64` is token `t`), cut to
    /// `len` tokens.
    pub fn from_words(len: usize, words: &[u64]) -> Self {
        let mut bits = words.to_vec();
        bits.resize(len.div_ceil(64), 0);
        if !len.is_multiple_of(64)
            && let Some(last) = bits.last_mut()
        {
            *last &= (1u64 << (len % 64)) - 1;
        }
        TokenMask { bits, len }
    }

    /// Adds `token` (ignored at or past the end).
    pub fn allow(&mut self, token: u32) {
        let t = token as usize;
        if t < self.len {
            self.bits[t / 64] |= 1 << (t % 64);
        }
    }

    /// Whether `token` is allowed (never past the end).
    pub fn allows(&self, token: u32) -> bool {
        let t = token as usize;
        t < self.len && self.bits[t / 64] & (1 << (t % 64)) != 0
    }

    /// Tokens `0..len` the set is over.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is over no tokens at all.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.bits.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The allowed tokens, in order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len as u32).filter(|&t| self.allows(t))
    }

    /// `token` when allowed, else the first allowed token after it, wrapping around to the
    /// lowest allowed one; `token` itself when nothing is allowed. How the test and emulated
    /// nodes, which have no logits to mask, turn their own choice into an allowed one.
    pub fn first_allowed_from(&self, token: u32) -> u32 {
        if self.allows(token) {
            return token;
        }
        self.iter()
            .find(|&t| t > token)
            .or_else(|| self.iter().next())
            .unwrap_or(token)
    }

    /// The bits as 64-bit words (for the wire).
    pub fn words(&self) -> &[u64] {
        &self.bits
    }
}

impl fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenMask({} of {})", self.count(), self.len)
    }
}

/// The grammar state of one sequence with constrained output.
pub trait TokenConstraint: Send + Sync {
    /// The tokens allowed after the tokens accepted so far. Called off the scheduling thread,
    /// once per sampling step. An error (the grammar cannot continue) fails the request.
    fn next_mask(&self) -> Result<TokenMask, String>;
    /// The token sampled under the last mask. An error (the grammar refuses it) fails the
    /// request.
    fn accept(&self, token: u32) -> Result<(), String>;
}

/// A sequence's constraint, shared by the scheduler (which accepts tokens) and the thread that
/// computes masks. Equal when it is the same constraint.
#[derive(Clone)]
pub struct Constraint(pub Arc<dyn TokenConstraint>);

impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Constraint")
    }
}

type MaskResult = Result<Arc<TokenMask>, String>;

struct MaskCell {
    mask: Mutex<Option<MaskResult>>,
    ready: Condvar,
}

/// The tokens one row may sample: a mask that is filled in while the step runs. Clones share
/// it. Equal when it is the same handle.
#[derive(Clone)]
pub struct AllowedTokens(Arc<MaskCell>);

/// How long a node waits for a mask before it fails the step (a mask takes microseconds to
/// milliseconds; this only bounds a mask thread that died).
pub const MASK_WAIT: Duration = Duration::from_secs(30);

impl AllowedTokens {
    /// A handle to fill in later with [`AllowedTokens::fill`].
    pub fn pending() -> Self {
        AllowedTokens(Arc::new(MaskCell {
            mask: Mutex::new(None),
            ready: Condvar::new(),
        }))
    }

    /// A handle holding `mask` already.
    pub fn ready(mask: TokenMask) -> Self {
        let handle = AllowedTokens::pending();
        handle.fill(Ok(mask));
        handle
    }

    /// Sets the mask (or why there is none) and wakes whoever waits; a second fill is ignored.
    pub fn fill(&self, mask: Result<TokenMask, String>) {
        let mut slot = self.0.mask.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(mask.map(Arc::new));
            self.0.ready.notify_all();
        }
    }

    /// The mask, waiting up to `timeout` for it.
    pub fn wait(&self, timeout: Duration) -> Result<Arc<TokenMask>, String> {
        let slot = self.0.mask.lock().unwrap_or_else(|p| p.into_inner());
        let (slot, _) = self
            .0
            .ready
            .wait_timeout_while(slot, timeout, |m| m.is_none())
            .unwrap_or_else(|p| p.into_inner());
        match &*slot {
            Some(result) => result.clone(),
            None => Err(format!(
                "the allowed tokens were not computed within {timeout:?}"
            )),
        }
    }
}

impl PartialEq for AllowedTokens {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for AllowedTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let slot = self.0.mask.lock().unwrap_or_else(|p| p.into_inner());
        match &*slot {
            None => f.write_str("AllowedTokens(pending)"),
            Some(Ok(mask)) => write!(f, "AllowedTokens({mask:?})"),
            Some(Err(e)) => write!(f, "AllowedTokens(error: {e})"),
        }
    }
}

/// A mask to compute: the constraint, and the handle its rows wait on.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskJob {
    /// The sequence's grammar state.
    pub constraint: Constraint,
    /// Where the mask goes.
    pub allowed: AllowedTokens,
}

impl MaskJob {
    /// Computes the mask and fills the handle (an empty mask is an error: nothing could be
    /// sampled).
    pub fn run(&self) {
        let mask = self.constraint.0.next_mask().and_then(|m| {
            if m.count() == 0 {
                Err("the output's grammar allows no token here".to_string())
            } else {
                Ok(m)
            }
        });
        self.allowed.fill(mask);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_mask_holds_exactly_the_tokens_put_in(len in 0usize..300, tokens in proptest::collection::vec(0u32..320, 0..40)) {
            let m = TokenMask::from_tokens(len, tokens.iter().copied());
            let mut expected: Vec<u32> = tokens.iter().copied().filter(|&t| (t as usize) < len).collect();
            expected.sort_unstable();
            expected.dedup();
            prop_assert_eq!(m.iter().collect::<Vec<_>>(), expected.clone());
            prop_assert_eq!(m.count(), expected.len());
            let again = TokenMask::from_words(len, m.words());
            prop_assert_eq!(&again, &m);
            for t in 0..len as u32 + 70 {
                prop_assert_eq!(m.allows(t), expected.contains(&t));
            }
        }
    }

    #[test]
    fn the_first_allowed_token_from_a_choice_wraps_around() {
        let m = TokenMask::from_tokens(16, [3, 9]);
        assert_eq!(m.first_allowed_from(3), 3);
        assert_eq!(m.first_allowed_from(4), 9);
        assert_eq!(m.first_allowed_from(10), 3, "wraps");
        assert_eq!(m.first_allowed_from(100), 3, "past the end");
        assert_eq!(
            TokenMask::none(16).first_allowed_from(5),
            5,
            "nothing allowed"
        );
    }

    #[test]
    fn words_past_the_end_are_cut() {
        let m = TokenMask::from_words(3, &[u64::MAX, u64::MAX]);
        assert_eq!(m.count(), 3);
        assert!(!m.allows(3));
        assert_eq!(TokenMask::all(130).count(), 130);
    }

    #[test]
    fn a_waiter_gets_the_mask_filled_from_another_thread_and_times_out_without() {
        let handle = AllowedTokens::pending();
        let filler = handle.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            filler.fill(Ok(TokenMask::from_tokens(10, [3])));
        });
        let mask = handle.wait(Duration::from_secs(10)).unwrap();
        assert!(mask.allows(3) && mask.count() == 1);
        t.join().unwrap();
        // The first fill wins.
        handle.fill(Err("late".into()));
        assert!(handle.wait(Duration::ZERO).is_ok());
        let never = AllowedTokens::pending();
        let err = never.wait(Duration::from_millis(1)).unwrap_err();
        assert!(err.contains("not computed"), "{err}");
    }

    struct Fixed(Vec<u32>);
    impl TokenConstraint for Fixed {
        fn next_mask(&self) -> Result<TokenMask, String> {
            Ok(TokenMask::from_tokens(8, self.0.iter().copied()))
        }
        fn accept(&self, _: u32) -> Result<(), String> {
            Ok(())
        }
    }

    #[test]
    fn a_job_that_allows_nothing_fails_its_rows() {
        let job = MaskJob {
            constraint: Constraint(Arc::new(Fixed(Vec::new()))),
            allowed: AllowedTokens::pending(),
        };
        job.run();
        let err = job.allowed.wait(Duration::ZERO).unwrap_err();
        assert!(err.contains("allows no token"), "{err}");
        let job = MaskJob {
            constraint: Constraint(Arc::new(Fixed(vec![2, 5]))),
            allowed: AllowedTokens::pending(),
        };
        job.run();
        assert_eq!(job.allowed.wait(Duration::ZERO).unwrap().count(), 2);
    }
}
