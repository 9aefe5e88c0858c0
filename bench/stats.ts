/** Percentile (0..100) of an unsorted sample, by nearest rank. */
export function percentile(values: readonly number[], p: number): number {
  if (values.length === 0) return NaN;
  const sorted = [...values].sort((a, b) => a - b);
  const rank = Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1));
  return sorted[rank]!;
}

export const median = (values: readonly number[]) => percentile(values, 50);

/** Jain's fairness index of per-worker counts: 1 when all equal, 1/n when one worker gets everything. */
export function jain(counts: readonly number[]): number {
  const sum = counts.reduce((a, b) => a + b, 0);
  const squares = counts.reduce((a, b) => a + b * b, 0);
  return squares === 0 ? NaN : (sum * sum) / (counts.length * squares);
}

export const round = (value: number, digits = 2) => Number(value.toFixed(digits));
