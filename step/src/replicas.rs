//! Which copy of a replicated expert computes which of its rows in one step: the rule the
//! attention node's dispatcher applies and the planner's model of a step mirrors, so the two
//! cannot disagree.
//!
//! A card's work for a layer is modeled in rows: an expert given `r` rows costs
//! `max(rows_per_weight_read, r)`, where `rows_per_weight_read` is the rows whose arithmetic
//! takes as long as one pass over the expert's weights (the card's performance model says, per
//! layer): below it the card waits on the weights, above it on the arithmetic. Experts with one
//! holder go to it. Replicated experts, the most-routed first, go to as few of their holders,
//! least loaded first, as bring the most loaded of them lowest: at small batches that is one
//! copy (the least loaded; a second would read the weights again and finish no sooner); an
//! expert hot enough to be compute bound is split so its copies finish together, as DeepSeek's
//! EPLB spreads a redundant expert's tokens over its copies.
//!
//! Pure and deterministic: the same routing always gives the same split (ties go to the
//! holder that `key`, the expert's first row's key, points at, and on from there), so the
//! node's results do not depend on timing.

/// vLLM's balancedness of devices with these loads: the mean load over the largest (1.0 when
/// every one has the same load, or none has any).
pub fn balancedness(loads: &[f64]) -> f64 {
    let max = loads.iter().copied().fold(0.0, f64::max);
    if max <= 0.0 {
        return 1.0;
    }
    loads.iter().sum::<f64>() / loads.len() as f64 / max
}

/// One copy's share of an expert's rows in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowShare {
    /// The card computing them.
    pub card: usize,
    /// How many of the expert's rows, taken in token order after the previous shares'.
    pub rows: usize,
}

/// Walks a step's rows in token order and says which card computes each: an expert's rows go
/// to its shares in turn, each taking as many as it was given (what both the node's dispatcher
/// and the planner's model of it need).
#[derive(Debug)]
pub struct ShareCursor<'a> {
    shares: &'a [Vec<RowShare>],
    /// Per expert: the share being given out and the rows it has had so far.
    at: Vec<(usize, usize)>,
}

impl<'a> ShareCursor<'a> {
    /// A cursor at every expert's first row.
    pub fn new(shares: &'a [Vec<RowShare>]) -> Self {
        ShareCursor {
            shares,
            at: vec![(0, 0); shares.len()],
        }
    }

    /// The card computing `expert`'s next row (`None` for an expert with no share, or whose
    /// shares are used up).
    pub fn next_card(&mut self, expert: usize) -> Option<usize> {
        let (share, given) = self.at.get_mut(expert)?;
        let RowShare { card, rows } = *self.shares.get(expert)?.get(*share)?;
        *given += 1;
        if *given == rows {
            (*share, *given) = (*share + 1, 0);
        }
        Some(card)
    }
}

/// What the split of one layer needs.
#[derive(Debug, Clone, Copy)]
pub struct SplitInput<'a> {
    /// `holders[expert]`: the cards holding it, ascending (empty for an expert of no card).
    pub holders: &'a [Vec<usize>],
    /// `rows[expert]`: rows routed to it this step.
    pub rows: &'a [usize],
    /// `keys[expert]`: its first row's key (any value where `rows` is 0).
    pub keys: &'a [u64],
    /// Number of cards.
    pub cards: usize,
    /// The rows one weight pass is worth on this layer's cards; `u32::MAX` never splits.
    pub rows_per_weight_read: u32,
}

/// Each expert's shares (empty for an expert no row routes to), in the order its rows are
/// given out.
pub fn split_rows(input: SplitInput<'_>) -> Vec<Vec<RowShare>> {
    let SplitInput {
        holders,
        rows,
        keys,
        cards,
        rows_per_weight_read,
    } = input;
    // An expert with rows costs at least one row, whatever the figure says.
    let c = u64::from(rows_per_weight_read.max(1));
    let mut shares = vec![Vec::new(); holders.len()];
    let mut load = vec![0u64; cards];
    let mut replicated = Vec::new();
    for (e, h) in holders.iter().enumerate() {
        let n = rows.get(e).copied().unwrap_or(0);
        match h.as_slice() {
            _ if n == 0 => {}
            [] => {}
            [card] => {
                shares[e].push(RowShare {
                    card: *card,
                    rows: n,
                });
                if let Some(l) = load.get_mut(*card) {
                    *l = l.saturating_add(c.max(n as u64));
                }
            }
            _ => replicated.push(e),
        }
    }
    replicated.sort_by_key(|&e| (std::cmp::Reverse(rows[e]), e));
    for e in replicated {
        let h = &holders[e];
        let key = keys.get(e).copied().unwrap_or(0);
        // Holders least loaded first; ties from the one the key points at.
        let mut order: Vec<(u64, usize, usize)> = (0..h.len())
            .map(|i| {
                let card = h[(key.wrapping_add(i as u64) % h.len() as u64) as usize];
                (load.get(card).copied().unwrap_or(u64::MAX), i, card)
            })
            .collect();
        order.sort_unstable();
        let loads: Vec<u64> = order.iter().map(|&(l, _, _)| l).collect();
        for (i, r) in fill(&loads, c, rows[e] as u64).into_iter().enumerate() {
            let card = order[i].2;
            if let Some(l) = load.get_mut(card) {
                *l = l.saturating_add(c.max(r));
            }
            shares[e].push(RowShare {
                card,
                rows: r as usize,
            });
        }
    }
    shares
}

/// `n` rows over copies whose loads are `loads` (ascending): the lowest level `T` that some
/// number `m` of the least loaded copies can take the rows under (each used copy ends at
/// `load + max(c, rows) <= T`), then each copy, least loaded first, filled up to `T` until the
/// rows run out. Returns the rows of each copy used (at least one each), in `loads` order.
fn fill(loads: &[u64], c: u64, n: u64) -> Vec<u64> {
    let mut level = u64::MAX;
    let mut sum = 0u64;
    for (j, &l) in loads.iter().enumerate() {
        sum = sum.saturating_add(l);
        let even = sum.saturating_add(n).div_ceil(j as u64 + 1);
        level = level.min(l.saturating_add(c).max(even));
    }
    // The least loaded copies up to the one that set `level` can take every row under it, each
    // room for at least `c >= 1` rows: filling them in order uses the fewest copies.
    let mut left = n;
    let mut given = Vec::new();
    for &l in loads {
        if left == 0 {
            break;
        }
        let take = left.min(level.saturating_sub(l));
        given.push(take);
        left -= take;
    }
    debug_assert_eq!(left, 0, "the level holds every row");
    given
}

#[cfg(test)]
mod tests;
