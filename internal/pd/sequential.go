package pd

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/worker"
)

// Sequential runs vLLM's protocol: a one-token prefill tagged for the connector, then the
// decode with the client's body plus the kv_transfer_params the prefill returned (NIXL,
// passthrough) or Baton minted (Mooncake). Mooncake legs may instead go out at once
// (MooncakeConcurrent), the decode waiting for the KV.
type Sequential struct {
	Proxy   *proxy.Proxy
	Metrics *metrics.Metrics
	Log     *slog.Logger
	// DefaultConnector is the connector of vLLM prefill workers that configure none.
	DefaultConnector string
	// RequireHandoff fails a request with 502 instead of letting the decode recompute.
	RequireHandoff bool
	// MooncakeConcurrent sends Mooncake's two legs at once through Concurrent.
	MooncakeConcurrent bool
	// Concurrent runs concurrent dispatches.
	Concurrent *Parallel
	// Pairs learns which pairs fail at the seam; nil learns nothing.
	Pairs *worker.PairHealth
}

var _ Executor = (*Sequential)(nil)

// handoffPlan is what Baton will do about the KV of one request.
type handoffPlan struct {
	conn          Connector
	outcome       string      // decided before the prefill: a none-* outcome, or "" (decided after)
	probe         []byte      // the prefill leg, nil when the prefill is skipped
	prefillHeader http.Header // the DP rank pin, when the prefill has DP ranks
	decodeParams  []byte      // minted decode params (Mooncake)
}

func (x *Sequential) plan(req *Request, pair worker.Pair) (handoffPlan, error) {
	conn := ConnectorFor(pair.Prefill, x.DefaultConnector)
	p := handoffPlan{conn: conn}
	if req.N > 1 {
		p.outcome = HandoffNoneN // the handoff is single-consumer: skip the prefill, decode computes
		return p, nil
	}
	rank, pinned := 0, false
	if conn.DPSize > 1 && !conn.DPInvalid {
		rank, pinned = pair.Prefill.NextRank()
		p.prefillHeader = http.Header{openai.HeaderDPRank: {strconv.Itoa(rank)}}
	}
	var tag []byte
	switch conn.Mode {
	case ModeNixl:
		tag = nixlTag
	case ModeMooncake:
		engineID := conn.engineID(rank, pinned)
		if engineID == "" {
			p.outcome = HandoffNoneNoEngine // nothing to mint: a prefill would only waste its KV
			return p, nil
		}
		id := newTransferID()
		tag = mooncakePrefillTag(id)
		p.decodeParams = mooncakeDecodeParams(id, engineID, conn.BootstrapAddr)
	}
	probe, err := PrefillProbe(req.Path, req.Body, tag)
	if err != nil {
		return p, err
	}
	p.probe = probe
	return p, nil
}

// Execute implements Executor.
func (x *Sequential) Execute(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair) error {
	plan, err := x.plan(req, pair)
	if err != nil {
		e := &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidJSON, Message: err.Error()}
		return e
	}
	x.Metrics.PDConnectorMode.WithLabelValues(plan.conn.Mode).Inc()
	if plan.probe != nil && plan.conn.Mode == ModeMooncake && x.MooncakeConcurrent {
		return x.concurrentMooncake(rw, r, req, pair, plan)
	}
	model := x.Metrics.Model(req.Model)
	runtime := pair.Prefill.Runtime()
	start := time.Now()
	outcome := "success"
	defer func() { x.Metrics.PDRequests.WithLabelValues(model, "sequential", outcome).Inc() }()

	var pu prefillUsage
	params := plan.decodeParams
	handoff := plan.outcome
	if plan.probe != nil {
		body, err := x.prefill(r, req, pair, plan)
		if err != nil {
			outcome = "prefill_failed"
			if errors.Is(err, proxy.ErrClientGone) {
				outcome = "client_cancelled"
			}
			return err
		}
		x.Metrics.PDPrefillDuration.WithLabelValues(model, runtime).Observe(time.Since(start).Seconds())
		pu = readPrefillUsage(body)
		switch plan.conn.Mode {
		case ModeMooncake:
			handoff = HandoffMooncake
		default:
			if params = harvest(body); params != nil {
				handoff = plan.conn.Mode
			} else {
				handoff = HandoffNoneMissing
			}
		}
	}
	if err := x.report(rw, req, pair, plan.conn, handoff); err != nil {
		outcome = "handoff_required"
		return err
	}
	var dBody []byte
	if params != nil {
		dBody, err = openai.Set(req.Body, keyKVTransferParams, params)
	} else {
		dBody, err = openai.Delete(req.Body, keyKVTransferParams)
	}
	if err != nil {
		return err
	}
	started, err := x.decode(rw, r, req, pair, dBody, pu, start, model, runtime)
	switch {
	case err == nil:
	case errors.Is(err, proxy.ErrClientGone):
		outcome = "client_cancelled"
	case errors.Is(err, proxy.ErrAbort):
		outcome = "aborted"
	default:
		outcome = "decode_failed"
	}
	if params != nil && !started {
		x.abandoned(plan.conn, pair, outcome)
	}
	switch {
	case outcome == "success":
		x.Pairs.Record(pair.Prefill, pair.Decode, true)
	case params != nil && seamFailure(err):
		x.Pairs.Record(pair.Prefill, pair.Decode, false) // the decode failed on a handoff
	}
	return err
}

// prefill sends the probe and returns the prefill's body. A failure is returned as the client's
// error: a transport error is a 502, a non-2xx the prefill's exact status; the decode is never
// contacted.
func (x *Sequential) prefill(r *http.Request, req *Request, pair worker.Pair, plan handoffPlan) ([]byte, error) {
	ctx := r.Context() // carries the request's deadline
	release := pair.Prefill.Acquire()
	defer release()
	resp, err := x.Proxy.Send(ctx, r, pair.Prefill, req.Path, plan.probe, plan.prefillHeader)
	if err != nil {
		return nil, x.Proxy.Failure(r, pair.Prefill, LegPrefill, err)
	}
	defer resp.Body.Close()
	body, err := proxy.ReadBody(resp.Body)
	if err != nil {
		return nil, x.Proxy.Failure(r, pair.Prefill, LegPrefill, err)
	}
	pair.Prefill.Record(resp.StatusCode, nil)
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		e := upstreamError(LegPrefill, pair.Prefill, resp.StatusCode, resp.Header, body)
		x.Log.Warn("prefill leg failed; decode not contacted", "prefill", pair.Prefill.URL, "status", resp.StatusCode)
		return nil, e
	}
	return body, nil
}

// report makes the handoff outcome visible: response header, counter, and a log line when the
// decode will recompute. In strict mode a recompute is answered with 502 instead.
func (x *Sequential) report(rw http.ResponseWriter, req *Request, pair worker.Pair, conn Connector, handoff string) error {
	rw.Header().Set(openai.HeaderKVHandoff, handoff)
	x.Metrics.PDHandoffs.WithLabelValues(handoff, conn.Mode).Inc()
	if !strings.HasPrefix(handoff, HandoffNonePrefix) {
		return nil
	}
	log := x.Log.Warn
	if handoff == HandoffNoneN {
		log = x.Log.Info // by design: n>1 cannot consume a single-consumer handoff
	}
	log("decode recomputes the prompt: no KV handoff", "handoff", handoff, "connector", conn.String(),
		"prefill", pair.Prefill.URL, "decode", pair.Decode.URL, "model", req.Model, "strict", x.RequireHandoff)
	if !x.RequireHandoff {
		return nil
	}
	// A retry may land on a pair that hands off, unless nothing could: n>1, or no engine id.
	noRetry := handoff == HandoffNoneN || handoff == HandoffNoneNoEngine
	e := &openai.Error{Status: http.StatusBadGateway, Code: "kv_handoff_unavailable", NoRetry: noRetry,
		Message: fmt.Sprintf("no KV handoff for this request (%s, connector %s) and --pd-require-handoff is set", handoff, conn.Mode)}
	return e
}

// decode sends the decode leg and relays its answer, rewriting usage to the prefill's view.
// started reports whether the decode's first byte arrived (the handoff was consumed).
func (x *Sequential) decode(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair, body []byte, pu prefillUsage, start time.Time, model, runtime string) (started bool, err error) {
	ctx := r.Context()
	release := pair.Decode.Acquire()
	defer release()
	var hdr http.Header
	if rank, ok := pair.Decode.NextRank(); ok {
		hdr = http.Header{openai.HeaderDPRank: {strconv.Itoa(rank)}}
	}
	resp, err := x.Proxy.Send(ctx, r, pair.Decode, req.Path, body, hdr)
	if err != nil {
		return false, x.Proxy.Failure(r, pair.Decode, LegDecode, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		pair.Decode.Record(resp.StatusCode, nil)
		e := upstreamError(LegDecode, pair.Decode, resp.StatusCode, resp.Header, b)
		x.Log.Warn("decode leg failed", "decode", pair.Decode.URL, "prefill", pair.Prefill.URL, "status", resp.StatusCode)
		return false, e
	}
	resp.Body = &firstByte{ReadCloser: resp.Body, at: func() {
		started = true
		x.Metrics.PDTTFT.WithLabelValues(model, runtime).Observe(time.Since(start).Seconds())
	}}
	switch {
	case pu.ok && !isStream(resp):
		err = relayBody(rw, resp, func(b []byte) []byte { return fixUsage(b, pu) })
	case pu.ok:
		err = x.Proxy.Relay(rw, resp, func(ev []byte) []byte { return fixUsageEvent(ev, pu) })
	default:
		err = x.Proxy.Relay(rw, resp, nil)
	}
	if err == nil {
		pair.Decode.Record(resp.StatusCode, nil)
	}
	return started, x.Proxy.Finish(r, pair.Decode, LegDecode, err)
}

// abandoned counts a handoff prepared but never consumed: the prefill's KV stays pinned until
// the engine's timeout.
func (x *Sequential) abandoned(conn Connector, pair worker.Pair, outcome string) {
	x.Metrics.PDHandoffsAbandoned.WithLabelValues(conn.Mode).Inc()
	x.Log.Warn("KV handoff prepared but never consumed; the prefill holds it until its timeout",
		"connector", conn.Mode, "prefill", pair.Prefill.URL, "decode", pair.Decode.URL, "outcome", outcome)
}

// concurrentMooncake sends both Mooncake legs at once: the decode waits for the KV the prefill
// pushes under the minted transfer id.
func (x *Sequential) concurrentMooncake(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair, plan handoffPlan) error {
	if err := x.report(rw, req, pair, plan.conn, HandoffMooncake); err != nil {
		return err
	}
	dBody, err := openai.Set(req.Body, keyKVTransferParams, plan.decodeParams)
	if err != nil {
		return err
	}
	var dHeader http.Header
	if rank, ok := pair.Decode.NextRank(); ok {
		dHeader = http.Header{openai.HeaderDPRank: {strconv.Itoa(rank)}}
	}
	res := x.Concurrent.run(rw, r, req, pair, concurrentPlan{
		prefillBody: plan.probe, decodeBody: dBody, prefillHeader: plan.prefillHeader, decodeHeader: dHeader,
		dispatch: "concurrent", needPrefill: true,
		rewrite: func(p prefillResult) (func([]byte) []byte, func([]byte) []byte) {
			pu := readPrefillUsage(p.body)
			if !pu.ok {
				return nil, nil
			}
			return func(ev []byte) []byte { return fixUsageEvent(ev, pu) }, func(b []byte) []byte { return fixUsage(b, pu) }
		},
	})
	if !res.decodeStarted && res.outcome != "prefill_failed" && res.outcome != "success" {
		x.abandoned(plan.conn, pair, res.outcome)
	}
	return res.err
}
