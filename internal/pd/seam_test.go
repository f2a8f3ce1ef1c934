package pd

import (
	"context"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/worker"
)

// Which PD failures count against the pair (quarantine) is the outcome table's verdict on the
// one failure type. Baton running out of its own descriptors or ports says nothing of the pair:
// it used to be a 503 minted by Baton, which the status rule took for a broken pair's.
func TestSeamFailureIsTheTablesVerdict(t *testing.T) {
	w := worker.New(config.Worker{URL: "http://decode:1", Role: config.RoleDecode})
	exhausted := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.EMFILE}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, c := range []struct {
		name string
		err  error
		seam bool
	}{
		{"Baton out of descriptors", proxy.Classify(w, LegDecode, time.Second, exhausted), false},
		{"Baton's panic", proxy.Classify(w, LegPrefill, time.Second, &proxy.PanicError{Where: "prefill_leg"}), false},
		{"decode unreachable", proxy.Classify(w, LegDecode, time.Second, refused), true},
		{"decode timed out", proxy.Classify(w, LegDecode, time.Second, context.DeadlineExceeded), true},
		{"decode answered 503", upstreamError(LegDecode, w, 503, nil, nil), true},
		{"decode answered 400", upstreamError(LegDecode, w, 400, nil, nil), false},
		{"a stream cut after its first byte", proxy.ErrAbort, true},
		{"the client left", proxy.ErrClientGone, false},
		{"a failure marked final", &outcome.Failure{Status: 502, Final: true}, true},
	} {
		if got := seamFailure(c.err); got != c.seam {
			t.Errorf("%s: seamFailure = %v, want %v", c.name, got, c.seam)
		}
	}
}

// Each handoff outcome has one class: what the recompute alert counts is only a handoff that
// should have happened and did not.
func TestHandoffClass(t *testing.T) {
	for outcome, class := range map[string]string{
		HandoffNixl: ClassHandedOff, HandoffMooncake: ClassHandedOff, HandoffBootstrap: ClassHandedOff, HandoffPassthrough: ClassHandedOff,
		HandoffRecomputed: ClassRecomputed, HandoffNoneMissing: ClassRecomputed, HandoffNoneInvalid: ClassRecomputed, HandoffNoneNoEngine: ClassRecomputed,
		HandoffNoneN: ClassByDesign, HandoffNoneBatch: ClassByDesign, HandoffNoneRoute: ClassByDesign,
		HandoffNoneFailed: ClassFailed,
	} {
		if got := HandoffClass(outcome); got != class {
			t.Errorf("%s: class %s, want %s", outcome, got, class)
		}
	}
}
