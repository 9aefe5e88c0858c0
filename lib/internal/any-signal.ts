/**
 * A signal that aborts when any of `signals` aborts, with that signal's reason, and `dispose()` to
 * stop listening to them (it also stops on its own once it aborted). Unlike `AbortSignal.any`, it
 * leaves nothing on the signals it follows once disposed: `AbortSignal.any` leaves an entry on each
 * for every signal it makes, which Node 20 never removes (Node 22 and 26 only after a GC), so a
 * long-lived signal followed many times would keep them all.
 */
export function anySignal(signals: readonly AbortSignal[]): { signal: AbortSignal; dispose(): void } {
  const controller = new AbortController();
  const aborted = signals.find((s) => s.aborted);
  if (aborted) {
    controller.abort(aborted.reason);
    return { signal: controller.signal, dispose: () => undefined };
  }
  const dispose = (): void => {
    for (const s of signals) s.removeEventListener('abort', onAbort);
  };
  const onAbort = (event: Event): void => {
    dispose();
    controller.abort((event.target as AbortSignal).reason);
  };
  for (const s of signals) s.addEventListener('abort', onAbort);
  return { signal: controller.signal, dispose };
}
