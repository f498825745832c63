// Package outbox relays the outbox (the rows the notify built-in writes with its tool
// call's completion) to NATS JetStream: one relay at a time across replicas, exactly
// once per row, in order per channel, on the subject <prefix>.<tenant>.<channel>.
//
// Every replica runs [Relay.Run]; it acts only while it holds the relay lease in the
// store (store.Outbox), whose epoch fences the cursor. Exactly once does not rest on
// JetStream's duplicate window: each channel's cursor in the store keeps the stream
// sequence of the channel's last published message, every publish expects that sequence
// as the subject's last (Nats-Expected-Last-Subject-Sequence), so the server refuses a
// second copy whatever the time since the first, and a refused publish is settled by
// reading the subject's last message and comparing its Nats-Msg-Id (the row's key) with
// the row's. docs/outbox.md has the argument in full.
//
// [List] is the operator's view of the rows (`curfew outbox ls`, the admin API).
package outbox
