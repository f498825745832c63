// Package dlq records dead letters: steps and runs that failed for good (after all
// retries, or with a non-retryable error), where an operator can act on them.
//
// The store (package store) is the record: Recorder.Record adds the dead letter there,
// idempotent on tenant, run and step. When a JetStream publisher is configured, the dead
// letter is also published to NATS JetStream for external consumers, as JSON on the
// subject "<prefix>.<tenant>" of a stream the publisher creates if it is missing, with the
// dead letter's id as the Nats-Msg-Id, so that publishing the same dead letter twice within
// the stream's duplicate window stores one message.
//
// Defaults: stream DefaultStream ("CURFEW_DLQ"), subject prefix DefaultSubjectPrefix
// ("curfew.dlq"), file storage, messages kept DefaultMaxAge (14 days), duplicate window
// DefaultDuplicates (2 minutes).
//
// DepthCollector exports curfew_dlq_depth, read from the store at scrape time.
package dlq
