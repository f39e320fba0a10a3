//! Which copy of a replicated expert computes which of its rows in one step: the rule the
//! attention node's dispatcher applies and the planner's model of a step mirrors, so the two
//! cannot disagree.
//!
//! A card's work for a layer is modeled in rows (one row's arithmetic is the unit): an expert
//! given `r > 0` rows costs `f + max(c - f, r)`, where `c` (`rows_per_weight_read`) is what one
//! row costs in all, and `f` (`fixed_rows_per_copy`) the part of it that is the same however
//! many rows the copy computes (its instructions' fixed latencies); the rest, `c - f`, is the
//! pass over the weights, which the arithmetic overlaps. The card's performance model gives
//! both per layer. Experts with one holder go to it. Replicated experts, the most-routed first,
//! go to as few of their holders, least loaded first, as bring the most loaded of them lowest:
//! at small batches that is one copy (the least loaded; a second would read the weights again
//! and finish no sooner); an expert hot enough to be compute bound is split so its copies
//! finish together, as DeepSeek's EPLB spreads a redundant expert's tokens over its copies.
//!
//! Then, while moving some of a replicated expert's rows off the most loaded card onto another
//! of its holders lowers the larger of the two cards' loads, the best such move is made. The
//! greedy pass takes the experts one at a time and cannot undo an early choice: it leaves a
//! card holding a cold expert and a copy of the hot one with the cold one alone while the hot
//! one's other copies run over. On the Mixtral medium shape under Zipf-skewed routing at 64
//! tokens, the two (with `f`) take the slowest card from 13-19% over even routing to within
//! 10% (docs/bench/notes/2026-12-08-eplb-dispatch.md).
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
    /// What one row costs in all on this layer's cards, in rows of arithmetic: the weight pass
    /// and the fixed latencies (`c` above); `u32::MAX` never splits.
    pub rows_per_weight_read: u32,
    /// Of `rows_per_weight_read`, the rows a copy costs however many it computes (`f` above; 0:
    /// a copy costs the larger of its weight pass and its rows). At most `c - 1` counts.
    pub fixed_rows_per_copy: u32,
}

/// What a copy given `r` rows adds to its card's load: `fixed + max(weight, r)`, 0 for no rows.
#[derive(Debug, Clone, Copy)]
struct CopyCost {
    fixed: u64,
    weight: u64,
}

impl CopyCost {
    fn new(rows_per_weight_read: u32, fixed_rows_per_copy: u32) -> Self {
        // An expert with rows costs at least one row, whatever the figures say.
        let c = u64::from(rows_per_weight_read.max(1));
        let fixed = u64::from(fixed_rows_per_copy).min(c - 1);
        CopyCost {
            fixed,
            weight: c - fixed,
        }
    }

    fn of(self, r: u64) -> u64 {
        if r == 0 {
            0
        } else {
            self.fixed.saturating_add(self.weight.max(r))
        }
    }
}

/// Each expert's shares (empty for an expert no row routes to), in the order its rows are
/// given out.
pub fn split_rows(input: SplitInput<'_>) -> Vec<Vec<RowShare>> {
    let cost = CopyCost::new(input.rows_per_weight_read, input.fixed_rows_per_copy);
    let (mut shares, mut load) = greedy_split(input, cost);
    rebalance(&mut shares, &mut load, input.holders, cost);
    shares
}

/// The greedy pass: single holders first, then the replicated experts, most rows first, each
/// filled over its holders as [`fill`] says. Returns the shares and each card's load.
fn greedy_split(input: SplitInput<'_>, cost: CopyCost) -> (Vec<Vec<RowShare>>, Vec<u64>) {
    let SplitInput {
        holders,
        rows,
        keys,
        cards,
        ..
    } = input;
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
                    *l = l.saturating_add(cost.of(n as u64));
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
        // A copy used ends at `load + fixed + max(weight, rows)`: `fill`'s rule on the loads
        // with the fixed part added.
        let loads: Vec<u64> = order
            .iter()
            .map(|&(l, _, _)| l.saturating_add(cost.fixed))
            .collect();
        for (i, r) in fill(&loads, cost.weight, rows[e] as u64)
            .into_iter()
            .enumerate()
        {
            let card = order[i].2;
            if let Some(l) = load.get_mut(card) {
                *l = l.saturating_add(cost.of(r));
            }
            shares[e].push(RowShare {
                card,
                rows: r as usize,
            });
        }
    }
    (shares, load)
}

/// One move of [`rebalance`]: `rows` of `expert` from card `from` to card `to`, leaving the
/// larger of the two cards' loads at `peak`.
#[derive(Debug, Clone, Copy)]
struct RowMove {
    peak: u64,
    expert: usize,
    from: usize,
    to: usize,
    rows: u64,
}

/// While moving rows of one replicated expert from the most loaded card to another of its
/// holders lowers the larger of the two cards' loads below the most loaded's, makes the move
/// that lowers it most (ties: the lower expert, then the holder met first, then fewer rows).
/// Each move lowers the most loaded card and leaves the other below where it was, so the
/// loads, sorted, fall at every move and the loop ends; it is also capped.
fn rebalance(
    shares: &mut [Vec<RowShare>],
    load: &mut [u64],
    holders: &[Vec<usize>],
    cost: CopyCost,
) {
    // Only a replicated expert's rows can move: without one (most layers of most deployments)
    // there is nothing to look at, every step.
    let replicated: Vec<usize> = (0..shares.len())
        .filter(|&e| holders.get(e).is_some_and(|h| h.len() > 1) && !shares[e].is_empty())
        .collect();
    if replicated.is_empty() {
        return;
    }
    let cap = 4 * shares.iter().map(Vec::len).sum::<usize>() + load.len();
    for _ in 0..cap {
        // The most loaded card, the lowest index among equals.
        let Some(hi) = (0..load.len()).max_by(|&a, &b| load[a].cmp(&load[b]).then(b.cmp(&a)))
        else {
            return;
        };
        let mut best: Option<RowMove> = None;
        for &e in &replicated {
            let s = &shares[e];
            let Some(here) = s.iter().find(|x| x.card == hi) else {
                continue;
            };
            let r_from = here.rows as u64;
            for &to in holders.get(e).map_or(&[][..], Vec::as_slice) {
                if to == hi || to >= load.len() {
                    continue;
                }
                let r_to = s.iter().find(|x| x.card == to).map_or(0, |x| x.rows as u64);
                let from_after = |k: u64| load[hi] - cost.of(r_from) + cost.of(r_from - k);
                let to_after = |k: u64| load[to] - cost.of(r_to) + cost.of(r_to + k);
                // `from_after` falls and `to_after` rises with the rows moved: the best move is
                // at the first count where they cross, or just before it.
                let (mut lo, mut up) = (1, r_from);
                while lo < up {
                    let mid = lo + (up - lo) / 2;
                    if to_after(mid) >= from_after(mid) {
                        up = mid;
                    } else {
                        lo = mid + 1;
                    }
                }
                for k in [lo.saturating_sub(1), lo] {
                    if k == 0 || k > r_from {
                        continue;
                    }
                    let peak = from_after(k).max(to_after(k));
                    if peak < load[hi] && best.is_none_or(|b| peak < b.peak) {
                        best = Some(RowMove {
                            peak,
                            expert: e,
                            from: hi,
                            to,
                            rows: k,
                        });
                    }
                }
            }
        }
        let Some(m) = best else {
            return;
        };
        apply(&mut shares[m.expert], load, m, cost);
    }
}

/// Makes move `m` on its expert's shares and the cards' loads: a share left without rows is
/// removed, a holder new to the expert gets a share after the others.
fn apply(shares: &mut Vec<RowShare>, load: &mut [u64], m: RowMove, cost: CopyCost) {
    let rows_on = |shares: &[RowShare], card: usize| {
        shares
            .iter()
            .find(|x| x.card == card)
            .map_or(0, |x| x.rows as u64)
    };
    let (r_from, r_to) = (rows_on(shares, m.from), rows_on(shares, m.to));
    load[m.from] = load[m.from] - cost.of(r_from) + cost.of(r_from - m.rows);
    load[m.to] = load[m.to] - cost.of(r_to) + cost.of(r_to + m.rows);
    for s in shares.iter_mut() {
        if s.card == m.from {
            s.rows -= m.rows as usize;
        }
    }
    shares.retain(|s| s.rows > 0);
    match shares.iter_mut().find(|s| s.card == m.to) {
        Some(s) => s.rows += m.rows as usize,
        None => shares.push(RowShare {
            card: m.to,
            rows: m.rows as usize,
        }),
    }
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
