package kvevents

import (
	"context"
	"encoding/binary"
	"log/slog"
	"math"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Subscriber reads one engine's KV events (a ZMQ SUB socket connected to the engine's PUB
// endpoint, every topic) into an index under the worker's name. Sequence numbers are checked:
// one that goes backwards (the engine restarted) or skips (events were lost) clears the
// worker's blocks before the batch is applied — an index that believes in blocks the engine no
// longer holds is worse than one that knows less.
type Subscriber struct {
	Worker, Model, Endpoint string
	// Rank is the DP rank this endpoint publishes for, used when a batch names none.
	Rank int
	// ReplayEndpoint, when set, is the engine's replay ROUTER: a gap is filled from it before the
	// worker is given up on.
	ReplayEndpoint string
	// ModelOf, when Model is empty, names the model at each batch (a worker's model is known
	// only once it registered); a batch with no model yet is not applied.
	ModelOf func() string
	Index   *Index
	Log     *slog.Logger

	Received, Malformed, Ignored, Gaps, Resets, Replays atomic.Uint64
	nextSeq                                             atomic.Int64 // the last message's seq + 1; 0 before the first
	lastTS                                              atomic.Uint64
	lastOK                                              atomic.Bool
	blockSize                                           atomic.Int64
	groups                                              groups
	// stored and orphans count what the engine's events did to the index since the last
	// reset; unindexable is set once they say its hashes cannot be chained (unindexableAfter).
	stored, orphans atomic.Int64
	unindexable     atomic.Bool
}

// unindexableAfter is how many stored blocks whose parent is unknown, with none stored from the
// root, make an engine's events unindexable: an engine that chains its hashes from the root
// stores root blocks at once, while older SGLang hashes each block's content alone and names a
// parent even for the first block, so nothing it sends can be chained from a prompt's start.
const unindexableAfter = 32

// BlockSize is the engine's block size, from its last BlockStored event or what the engine
// reported (0 before either).
func (s *Subscriber) BlockSize() int { return int(s.blockSize.Load()) }

// SetBlockSize sets the block size the engine reported before its first event (0: unknown).
func (s *Subscriber) SetBlockSize(n int) {
	if n > 0 {
		s.blockSize.Store(int64(n))
	}
}

// Stats is a snapshot of a subscriber's counters.
type Stats struct {
	Received, Malformed, Ignored, Gaps, Resets, Replays uint64
	LastSeq                                             int64   // -1: none yet
	LastTS                                              float64 // the last batch's engine timestamp (Unix seconds)
	// Healthy: a batch arrived and the last one decoded and applied, and the engine's hashes can
	// be indexed.
	Healthy bool
	// Unindexable: the engine's hashes cannot be chained from a prompt's start (older SGLang);
	// routing for it uses the approximate index.
	Unindexable bool
}

// Stats returns the subscriber's counters.
func (s *Subscriber) Stats() Stats {
	return Stats{Received: s.Received.Load(), Malformed: s.Malformed.Load(), Ignored: s.Ignored.Load(), Gaps: s.Gaps.Load(),
		Resets: s.Resets.Load(), Replays: s.Replays.Load(), LastSeq: s.nextSeq.Load() - 1, LastTS: math.Float64frombits(s.lastTS.Load()),
		Healthy: s.lastOK.Load() && !s.unindexable.Load(), Unindexable: s.unindexable.Load()}
}

// Run subscribes until ctx ends, redialling a lost engine.
func (s *Subscriber) Run(ctx context.Context) {
	sock := zmq4.NewSub(ctx, zmq4.WithLogger(slog.NewLogLogger(s.Log.Handler(), slog.LevelDebug)), zmq4.WithAutomaticReconnect(true), zmq4.WithDialerRetry(250*time.Millisecond), zmq4.WithDialerMaxRetries(-1))
	defer sock.Close()
	for ctx.Err() == nil {
		if err := sock.Dial(dialAddr(s.Endpoint)); err != nil {
			s.Log.Warn("kv events: cannot connect", "worker", s.Worker, "endpoint", s.Endpoint, "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
			continue
		}
		break
	}
	receive(ctx, sock, s.handle)
}

// receive subscribes sock to every topic and hands each message's frames to handle until ctx
// ends.
func receive(ctx context.Context, sock zmq4.Socket, handle func([][]byte)) {
	_ = sock.SetOption(zmq4.OptionSubscribe, "")
	for ctx.Err() == nil {
		msg, err := sock.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			time.Sleep(50 * time.Millisecond)
			continue
		}
		handle(msg.Frames)
	}
}

// handle applies one message: [topic, seq, payload].
func (s *Subscriber) handle(frames [][]byte) {
	s.Received.Add(1)
	if len(frames) != 3 || len(frames[1]) != 8 {
		s.Malformed.Add(1)
		s.lastOK.Store(false)
		return
	}
	seq := int64(binary.BigEndian.Uint64(frames[1]))
	b, err := Decode(frames[2])
	if err != nil {
		s.Malformed.Add(1)
		s.lastOK.Store(false)
		s.Log.Warn("kv events: undecodable batch", "worker", s.Worker, "err", err)
		return
	}
	s.deliver(seq, b)
}

// deliver applies a decoded batch with sequence number seq: a backwards sequence (the engine
// restarted) forgets the worker's blocks, a gap is replayed or forgets them.
func (s *Subscriber) deliver(seq int64, b Batch) {
	if last := s.nextSeq.Load() - 1; last >= 0 && seq != last+1 {
		switch {
		case seq <= last:
			s.Resets.Add(1)
			s.Log.Info("kv events: sequence went back, the engine restarted: forgetting its blocks", "worker", s.Worker, "seq", seq, "last", last)
			s.forget()
		case s.ReplayEndpoint != "":
			switch s.replay(last, seq) {
			case replayed:
				s.Gaps.Add(1)
				s.Replays.Add(1)
			case replayRestarted:
				// The replay comes from a new process whose own sequence has passed the old one's:
				// its batch at the last seq applied is not the one applied.
				s.Resets.Add(1)
				s.Log.Info("kv events: the engine restarted (its replay is another process's): forgetting its blocks", "worker", s.Worker, "seq", seq, "last", last)
				s.forget()
			default:
				s.Gaps.Add(1)
				s.Log.Warn("kv events: gap, events were lost and cannot be replayed: forgetting the worker's blocks", "worker", s.Worker, "seq", seq, "last", last)
				s.forget()
			}
		default:
			s.Gaps.Add(1)
			s.Log.Warn("kv events: gap, events were lost: forgetting the worker's blocks", "worker", s.Worker, "seq", seq, "last", last)
			s.forget()
		}
	}
	s.nextSeq.Store(seq + 1)
	s.apply(b)
}

// apply applies one decoded batch under the worker's model.
func (s *Subscriber) apply(b Batch) {
	s.lastTS.Store(math.Float64bits(b.TS))
	s.Ignored.Add(uint64(b.Ignored))
	model := s.Model
	if model == "" && s.ModelOf != nil {
		model = s.ModelOf()
	}
	if model == "" {
		s.lastOK.Store(false)
		return
	}
	kept := b.Events[:0]
	for _, e := range b.Events {
		if e.Kind != KindCleared && !s.groups.indexed(&e) {
			continue // a group whose blocks hold no whole prefix (sliding window, …): groups.go
		}
		if e.Kind == KindStored && e.BlockSize > 0 {
			s.blockSize.Store(int64(e.BlockSize)) // the indexed group's block size
		}
		kept = append(kept, e)
	}
	b.Events = kept
	if !b.HasDPRank {
		b.DPRank = s.Rank
	}
	a := s.Index.Apply(s.Worker, model, b)
	s.lastOK.Store(true)
	s.judge(a)
}

// judge counts what a batch did and, the first time the engine's events turn out unindexable,
// says so once.
func (s *Subscriber) judge(a Applied) {
	if a.Cleared > 0 {
		s.stored.Store(0)
		s.orphans.Store(0)
	}
	stored, orphans := s.stored.Add(int64(a.Stored)), s.orphans.Add(int64(a.Orphans))
	if stored == 0 && orphans >= unindexableAfter && s.unindexable.CompareAndSwap(false, true) {
		s.Log.Warn("kv events: the engine's block hashes cannot be indexed (each block hashed alone, a parent named even for a prompt's first block: older SGLang); routing for this worker uses the approximate index — upgrade the engine to route from its events",
			"worker", s.Worker, "orphaned_blocks", orphans)
	}
	if stored > 0 && s.unindexable.CompareAndSwap(true, false) {
		s.Log.Info("kv events: the engine's block hashes can be indexed again", "worker", s.Worker)
	}
}

// What a replay found.
type replayResult int

const (
	replayFailed    replayResult = iota // the engine no longer has them all, or did not answer
	replayed                            // every missing batch was applied
	replayRestarted                     // the engine's batch at last is not the one applied: a new process
)

// replay asks the engine's replay endpoint for the batches last..upto-1 and, when its batch at
// last is the one applied last (the same engine timestamp), applies the rest in order. A
// different batch at last means the endpoint answers for a new process (the engine restarted
// and its sequence passed the old one's): nothing is applied.
func (s *Subscriber) replay(last, upto int64) replayResult {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	sock := zmq4.NewDealer(ctx)
	defer sock.Close()
	if err := sock.Dial(dialAddr(s.ReplayEndpoint)); err != nil {
		return replayFailed
	}
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], uint64(last))
	if err := sock.Send(zmq4.NewMsgFrom(nil, start[:])); err != nil {
		return replayFailed
	}
	want := last
	var batches []Batch
	for {
		msg, err := sock.Recv()
		if err != nil {
			return replayFailed
		}
		// ["", seq, payload] (older vLLM) or ["", topic, seq, payload].
		f := msg.Frames
		if len(f) == 4 {
			f = f[2:]
		} else if len(f) == 3 {
			f = f[1:]
		} else {
			return replayFailed
		}
		if len(f[0]) != 8 {
			return replayFailed
		}
		seq := int64(binary.BigEndian.Uint64(f[0]))
		if seq == -1 {
			break
		}
		if seq < want || seq >= upto {
			continue
		}
		if seq != want {
			return replayFailed // the engine no longer has some of them
		}
		b, err := Decode(f[1])
		if err != nil {
			return replayFailed
		}
		if seq == last && math.Float64bits(b.TS) != s.lastTS.Load() {
			return replayRestarted
		}
		batches = append(batches, b)
		want++
	}
	if want != upto || len(batches) == 0 {
		return replayFailed
	}
	for _, b := range batches[1:] { // the first is the one applied last
		s.apply(b)
	}
	return replayed
}

// forget clears what the index believes of the worker, and what was judged of its hashes (a
// restarted engine may run another version).
func (s *Subscriber) forget() {
	s.Index.ClearWorker(s.Worker)
	s.stored.Store(0)
	s.orphans.Store(0)
	s.unindexable.Store(false)
}
