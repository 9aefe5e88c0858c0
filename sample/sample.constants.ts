/** The sample's own Redis connection, for balances and the job journal (not for locks). */
export const SAMPLE_REDIS = Symbol('sample-redis');
/** The SampleOptions the app was registered with. */
export const SAMPLE_OPTIONS = Symbol('sample-options');
