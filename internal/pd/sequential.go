package pd

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"

	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/routes"
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
	// Redecode chooses another decode worker for prefill's handoff, avoiding those in avoid;
	// nil never retries a decode alone.
	Redecode func(ctx context.Context, prefill *worker.Worker, req *Request, avoid map[string]bool) (*worker.Worker, error)
	// RedecodeAttempts bounds the decode retries of one handoff.
	RedecodeAttempts int
}

var _ Executor = (*Sequential)(nil)

// RedecodeOver is a Redecode that chooses through sel: another decode worker for the prefill
// (its connector and runtime), the request's adapter loaded on it when sel manages adapters.
func RedecodeOver(sel *policy.Selector) func(ctx context.Context, prefill *worker.Worker, req *Request, avoid map[string]bool) (*worker.Worker, error) {
	return func(ctx context.Context, prefill *worker.Worker, req *Request, avoid map[string]bool) (*worker.Worker, error) {
		d, err := sel.Decode(ctx, prefill, &policy.Request{Model: req.Model, Path: req.Path, Body: req.Body, Parsed: req.Request}, avoid)
		if err == nil && sel.Adapters != nil {
			err = sel.Adapters.Ensure(ctx, d, req.Model) // the new decode must have the adapter too
		}
		return d, err
	}
}

// handoffPlan is what Baton will do about the KV of one request.
type handoffPlan struct {
	conn          Connector
	outcome       string      // decided before the prefill: a none-* outcome, or "" (decided after)
	probe         []byte      // the prefill leg, nil when the prefill is skipped
	prefillHeader http.Header // the DP rank pin, when the prefill has DP ranks
	prefillRank   int         // that rank plus one; 0: none
	decodeParams  []byte      // minted decode params (Mooncake)
}

func (x *Sequential) plan(req *Request, pair worker.Pair) (handoffPlan, error) {
	conn := ConnectorFor(pair.Prefill, x.DefaultConnector)
	p := handoffPlan{conn: conn}
	switch {
	case req.Samples > 1 || req.N > 1:
		p.outcome = HandoffNoneN // the handoff is single-consumer: skip the prefill, decode computes
		return p, nil
	case req.Batch > 0:
		p.outcome = HandoffNoneBatch // params come back for the first prompt only
		return p, nil
	case !routes.Of(req.Path).VLLMHandoff:
		p.outcome = HandoffNoneRoute // the engine would ignore the tag: a prefill would be wasted
		return p, nil
	}
	rank, pinned := 0, false
	if conn.DPSize > 1 && !conn.DPInvalid {
		rank, pinned = prefillRank(pair.Prefill, req, conn.DPSize)
		p.prefillHeader = http.Header{openai.HeaderDPRank: {strconv.Itoa(rank)}}
		p.prefillRank = rank + 1
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
	s, err := x.start(rw, r, req, pair)
	if s == nil {
		return err
	}
	err = s.run()
	s.count()
	return err
}

// start plans a sequential dispatch: the sequence to run, or none and the request's result when
// it ends here (a body the plan refuses, a Mooncake handoff sent both legs at once). (Apart
// from Execute, like every step below, so that a stream waits under small frames: a goroutine's
// stack shrinks to half only when it uses under a quarter of it.)
//
//go:noinline
func (x *Sequential) start(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair) (*sequence, error) {
	if req.Rec == nil {
		req.Rec = &record.Record{} // a caller that reads nothing back
	}
	plan, err := x.plan(req, pair)
	if err != nil {
		return nil, outcome.Answer(&openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidJSON, Message: err.Error()})
	}
	x.Metrics.PDConnectorMode.WithLabelValues(plan.conn.Mode).Inc()
	if plan.probe != nil && plan.conn.Mode == ModeMooncake && x.MooncakeConcurrent {
		return nil, x.concurrentMooncake(rw, r, req, pair, plan)
	}
	return &sequence{x: x, rw: rw, r: r, req: req, pair: pair, plan: plan,
		model: x.Metrics.Model(req.Model), runtime: pair.Prefill.Runtime(), start: time.Now(), outcome: OutcomeSuccess}, nil
}

// count counts the dispatch by its outcome.
//
//go:noinline
func (s *sequence) count() {
	s.x.Metrics.PDRequests.WithLabelValues(s.model, "sequential", string(s.outcome)).Inc()
}

// sequence is one sequential dispatch in progress: the prefill, then the decode.
type sequence struct {
	x    *Sequential
	rw   http.ResponseWriter
	r    *http.Request // carries the request's deadline
	req  *Request
	pair worker.Pair
	plan handoffPlan

	model, runtime string
	start          time.Time
	outcome        Outcome
	unreached      bool         // the last decode leg could not connect to its worker
	check          kvCheck      // what the decode's usage says about the handoff
	handed         bool         // the decode was given kv_transfer_params
	pu             prefillUsage // the prefill's usage, when it answered with one
}

func (s *sequence) run() error {
	handoff, started, err := s.legs()
	s.settle(handoff, started, err)
	return err
}

// settle records the dispatch's handoff once its legs ended.
//
//go:noinline
func (s *sequence) settle(handoff string, started bool, err error) {
	if err != nil && !started && handoff != "" && !strings.HasPrefix(handoff, HandoffNonePrefix) {
		handoff = HandoffNoneFailed // prepared, never consumed: nothing was handed off
	}
	if handoff == "" || err != nil && outcome.FailureOf(err).Phase == outcome.InBand {
		handoff = HandoffNoneFailed // the prefill failed, or the decode reported a failure in its stream
	}
	if s.handed && started {
		s.req.Consumed = s.check.verdict()
	}
	if s.check.recomputed() && !strings.HasPrefix(handoff, HandoffNonePrefix) {
		s.x.recomputed(s.req, s.pair, s.plan.conn.Mode, handoff)
		handoff = HandoffRecomputed
	}
	noteHandoff(s.req.Rec, handoff)
	s.x.Metrics.PDHandoffs.WithLabelValues(handoff, HandoffClass(handoff), s.plan.conn.Mode).Inc()
}

// recomputed says loudly that a decode computed the prompt it was handed the KV of.
func (x *Sequential) recomputed(req *Request, pair worker.Pair, mode, handoff string) {
	x.Log.Warn("decode recomputed the prompt although its KV was handed off (its usage reports the prompt as computed)",
		"handoff", handoff, "connector", mode, "prefill", pair.Prefill.URL, "decode", pair.Decode.URL, "model", req.Model)
}

// legs runs the prefill, then the decode, and says which handoff the decode was given ("" when
// none could be, the prefill having failed) and whether its answer began.
func (s *sequence) legs() (handoff string, started bool, err error) {
	dBody, handoff, err := s.beforeDecode()
	if err != nil {
		return handoff, false, err
	}
	started, err = s.decodeAgain(dBody)
	s.afterDecode(started, err)
	return handoff, started, err
}

// beforeDecode runs the prefill and returns the decode's body, with the handoff it carries.
//
//go:noinline
func (s *sequence) beforeDecode() (dBody []byte, handoff string, err error) {
	params, handoff := s.plan.decodeParams, s.plan.outcome
	if s.plan.probe != nil {
		body, err := s.prefill()
		if err != nil {
			s.outcome = OutcomePrefillFailed
			if outcome.FailureOf(err).Kind() == outcome.KindClientGone {
				s.outcome = OutcomeClientCancelled
			}
			return nil, "", err
		}
		s.req.Rec.PrefillTime = time.Since(s.start)
		s.x.Metrics.PDPrefillDuration.WithLabelValues(s.model, s.runtime).Observe(s.req.Rec.PrefillTime.Seconds())
		s.pu = readPrefillUsage(body)
		if s.pu.ok {
			s.req.Rec.EnginePrompt = s.pu.prompt
		}
		params, handoff = s.handoff(body, params)
		s.plan.probe = nil // sent: not held for the stream's life
	}
	if err := s.x.report(s.r, s.req, s.pair, s.plan.conn, handoff); err != nil {
		s.outcome = OutcomeHandoffRequired
		return nil, handoff, err
	}
	dBody, err = decodeBody(s.req.Body, params)
	if err != nil {
		return nil, handoff, err
	}
	s.handed = params != nil
	return dBody, handoff, nil
}

// afterDecode records the decode's outcome, on the pair's health too.
//
//go:noinline
func (s *sequence) afterDecode(started bool, err error) {
	s.outcome = outcomeOf(err, OutcomeDecodeFailed)
	if s.handed && !started {
		s.x.abandoned(s.plan.conn, s.pair, s.outcome)
	}
	switch {
	case s.outcome == OutcomeSuccess:
		s.x.Pairs.Record(s.pair.Prefill, s.pair.Decode, true)
	case s.handed && seamFailure(err):
		s.x.Pairs.Record(s.pair.Prefill, s.pair.Decode, false) // the decode failed on a handoff
	}
}

// handoff returns the decode's kv_transfer_params and the handoff outcome once the prefill
// answered with body: Mooncake's minted params, or those the prefill returned.
func (s *sequence) handoff(body, minted []byte) ([]byte, string) {
	if s.plan.conn.Mode == ModeMooncake {
		return minted, HandoffMooncake
	}
	params, valid := harvest(body)
	switch {
	case valid:
		return params, s.plan.conn.Mode
	case params != nil:
		return nil, HandoffNoneInvalid
	}
	return nil, HandoffNoneMissing
}

// decodeBody is the client's body with kv_transfer_params set to params, or without any.
func decodeBody(body, params []byte) ([]byte, error) {
	if params != nil {
		return openai.Set(body, keyKVTransferParams, params)
	}
	return openai.Delete(body, keyKVTransferParams)
}

// decodeAgain sends the decode leg and, while the decode could not even be reached (its
// connection never opened, so no engine saw the request), sends it again to another decode
// worker with the same handoff: the KV is still pinned on the prefill, and a new pair would
// waste the prefill's work.
//
// After any HTTP answer from a decode the handoff is spent: vLLM (≥ 0.21) tells the prefill to
// free the blocks when its serving layer refuses a request (overload 503, a 4xx, a 500 before
// the engine took it), and a decode that pulled the KV and then failed freed them too. Another
// decode given the same params would read blocks the prefill may already have reused — NIXL
// cannot tell, and the answer would be 200 and wrong. Such a failure goes back to the request's
// retry loop, which starts over with a new pair and a new prefill.
func (s *sequence) decodeAgain(body []byte) (bool, error) {
	d, err := s.decodeHeadAgain(body)
	if d == nil {
		return false, err
	}
	// The decode's body is not referenced past here: an open stream does not hold it.
	return s.decode(d)
}

// decodeHeadAgain sends the decode leg, again to other decode workers while it could not be
// reached, and returns its answer to relay, or none and the last leg's failure.
//
//go:noinline
func (s *sequence) decodeHeadAgain(body []byte) (*decoding, error) {
	d, err := s.decodeHead(body)
	var avoid map[string]bool
	for n := 0; d == nil && s.handed && s.unreached && n < s.x.RedecodeAttempts && s.x.Redecode != nil && retryableLeg(err); n++ {
		if avoid == nil {
			avoid = map[string]bool{}
		}
		avoid[s.pair.Decode.URL] = true
		next, serr := s.x.Redecode(s.r.Context(), s.pair.Prefill, s.req, avoid)
		if serr != nil {
			break
		}
		s.x.Metrics.PDDecodeRetries.Inc()
		s.x.Log.Info("decode could not be reached; sending the decode alone to another worker with the same handoff",
			"failed", s.pair.Decode.URL, "decode", next.URL, "prefill", s.pair.Prefill.URL, "err", proxy.LogCause(err))
		s.pair.Decode = next
		noteDecode(s.req.Rec, next.URL)
		d, err = s.decodeHead(body)
	}
	return d, err
}

// retryableLeg reports whether a leg's failure before its first byte may succeed elsewhere.
func retryableLeg(err error) bool {
	return err != nil && outcome.FailureOf(err).Verdict().Retryable
}

// prefill sends the probe and returns the prefill's body. A failure is returned as the client's
// error: a transport error is a 502, a non-2xx the prefill's exact status; the decode is never
// contacted.
func (s *sequence) prefill() ([]byte, error) {
	leg := &proxy.Leg{}
	leg.Start(s.pair.Prefill, LegPrefill)
	leg.OnRank(s.plan.prefillRank - 1)
	defer leg.Excuse()
	resp, err := s.x.Proxy.Send(s.r.Context(), s.r, leg, proxy.Call{Path: s.req.Path, Body: s.plan.probe, Header: s.plan.prefillHeader, Rec: s.req.Rec})
	rec := s.req.Rec
	if err != nil {
		// Connected but unanswered (the client left, the deadline passed): the prefill was
		// computing the prompt, and its tenant is charged it.
		rec.PrefillComputed = rec.PrefillComputed || !proxy.Unreached(err)
		return nil, s.x.Proxy.Failure(s.r, leg, err)
	}
	rec.PrefillComputed = rec.PrefillComputed || resp.StatusCode < 300
	defer resp.Body.Close()
	body, err := proxy.ReadBody(resp.Body, resp.ContentLength)
	if err != nil {
		return nil, s.x.Proxy.Failure(s.r, leg, err)
	}
	leg.Done(resp.StatusCode, nil)
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		s.x.Log.Warn("prefill leg failed; decode not contacted", "prefill", s.pair.Prefill.URL, "status", resp.StatusCode)
		return nil, upstreamError(LegPrefill, s.pair.Prefill, resp.StatusCode, resp.Header, body)
	}
	return body, nil
}

// decode relays the decode leg's answer d, rewriting usage to the prefill's view. started
// reports whether the decode's first byte arrived (the handoff was consumed).
func (s *sequence) decode(d *decoding) (started bool, err error) {
	defer d.close()
	if d.whole {
		err = relayBody(s.req.Rec, s.rw, d.resp, d.transform)
	} else {
		err = s.x.Proxy.Relay(s.r.Context(), s.rw, d.resp, d.transform, s.req.Rec, s.req.Orders.On(d.leg.W), d.abort)
	}
	return d.started, s.x.Proxy.Finish(s.r, &d.leg, d.resp.StatusCode, err)
}

// decoding is a decode leg whose answer is being relayed (on the heap, like the relay's state).
type decoding struct {
	leg       proxy.Leg
	resp      *http.Response
	transform func([]byte) []byte // the usage check and rewrite, nil when neither is asked
	whole     bool                // a whole answer, not a stream: relayed by relayBody
	started   bool                // the answer's first byte arrived
	// abort ends a stream's decode exchange (its stall watch's); nil without one.
	abort context.CancelCauseFunc
}

func (d *decoding) close() {
	d.resp.Body.Close()
	d.leg.Excuse()
	d.end()
}

// end ends the decode exchange's own context, if it has one.
func (d *decoding) end() {
	if d.abort != nil {
		d.abort(nil)
	}
}

// decodeHead sends the decode leg and returns its answer to relay, or none and the leg's
// failure.
//
//go:noinline
func (s *sequence) decodeHead(body []byte) (*decoding, error) {
	d := &decoding{}
	d.leg.Start(s.pair.Decode, LegDecode)
	var hdr http.Header
	if rank, ok := s.pair.Decode.NextRank(); ok {
		hdr = http.Header{openai.HeaderDPRank: {strconv.Itoa(rank)}}
		d.leg.OnRank(rank)
	}
	ctx, abort := s.x.Proxy.Streamed(s.r.Context(), s.req.Stream)
	d.abort = abort
	resp, err := s.x.Proxy.Send(ctx, s.r, &d.leg, proxy.Call{Path: s.req.Path, Body: body, Header: hdr, Rec: s.req.Rec})
	s.unreached = err != nil && proxy.Unreached(err)
	if err != nil {
		defer d.end()
		defer d.leg.Excuse()
		return nil, s.x.Proxy.Failure(s.r, &d.leg, err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		defer d.end()
		defer d.leg.Excuse()
		defer resp.Body.Close()
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		d.leg.Done(resp.StatusCode, nil)
		s.x.Log.Warn("decode leg failed", "decode", s.pair.Decode.URL, "prefill", s.pair.Prefill.URL, "status", resp.StatusCode)
		return nil, upstreamError(LegDecode, s.pair.Decode, resp.StatusCode, resp.Header, b)
	}
	resp.Body = onFirstByte(resp.Body, func() {
		d.started = true
		s.x.Metrics.PDTTFT.WithLabelValues(s.model, s.runtime).Observe(time.Since(s.start).Seconds())
	})
	d.resp = resp
	check := &s.check
	if !s.handed {
		check = nil
	}
	switch {
	case (s.pu.ok || check != nil) && !isStream(resp):
		d.whole, d.transform = true, checkedBody(s.req.Rec, check, s.pu)
	case s.pu.ok || check != nil:
		d.transform = checkedEvent(check, s.pu)
	}
	return d, nil
}

// checkedBody returns the transform of a decode's whole answer: the decode's usage checked when
// check is set (a recompute is noted on the record before this answer's head, which names it),
// then rewritten to the prefill's view when pu is known.
func checkedBody(rec *record.Record, check *kvCheck, pu prefillUsage) func([]byte) []byte {
	return func(b []byte) []byte {
		t := scanTop(b) // once, for the check and the rewrite
		if check != nil && check.observeTop(t) {
			noteHandoff(rec, HandoffRecomputed)
		}
		if !pu.ok {
			return b
		}
		return fixUsageTop(b, t, pu)
	}
}

// checkedEvent is checkedBody for one streamed event. A stream's head left with its first event, so
// a recompute seen in its usage is reported in the metric and the log, not in the header.
// A client strips the byte order mark a stream may begin with (the HTML standard decodes an event
// stream so), so the first event is read without it, and the mark is kept in front.
func checkedEvent(check *kvCheck, pu prefillUsage) func([]byte) []byte {
	first := true
	return func(ev []byte) []byte {
		if !first {
			return checkEvent(ev, check, pu)
		}
		first = false
		rest, bom := bytes.CutPrefix(ev, []byte("\xEF\xBB\xBF"))
		if !bom {
			return checkEvent(ev, check, pu)
		}
		if out := checkEvent(rest, check, pu); !bytes.Equal(out, rest) {
			return append([]byte("\xEF\xBB\xBF"), out...)
		}
		return ev
	}
}

// report makes the planned handoff visible: on the record (the response header is rendered from
// it), and a log line when the decode will recompute. In strict mode a recompute is answered with 502 instead. The counter is taken
// once the request ended, with what really happened.
func (x *Sequential) report(r *http.Request, req *Request, pair worker.Pair, conn Connector, handoff string) error {
	noteHandoff(req.Rec, handoff)
	if !strings.HasPrefix(handoff, HandoffNonePrefix) {
		return nil
	}
	log := x.Log.Warn
	if handoff == HandoffNoneN || handoff == HandoffNoneBatch || handoff == HandoffNoneRoute {
		log = x.Log.Info // by design: no single handoff can serve these requests
	}
	log("decode recomputes the prompt: no KV handoff", "handoff", handoff, "connector", conn.String(),
		"prefill", pair.Prefill.URL, "decode", pair.Decode.URL, "model", req.Model, "strict", x.RequireHandoff)
	if !x.RequireHandoff {
		return nil
	}
	// A retry may land on a pair that hands off, unless nothing could: n>1, or no engine id.
	noRetry := handoff == HandoffNoneN || handoff == HandoffNoneNoEngine || handoff == HandoffNoneBatch || handoff == HandoffNoneRoute
	return &outcome.Failure{Status: http.StatusBadGateway, Final: noRetry, Answer: &openai.Error{Status: http.StatusBadGateway, Code: openai.CodeKVHandoffUnavailable,
		Message: fmt.Sprintf("no KV handoff for this request (%s, connector %s) and --pd-require-handoff is set", handoff, conn.Mode)}}
}

// abandoned counts a handoff prepared but never consumed: the prefill frees its KV when the
// decode refused the request (vLLM ≥ 0.21), else at the engine's timeout.
func (x *Sequential) abandoned(conn Connector, pair worker.Pair, outcome Outcome) {
	x.Metrics.PDHandoffsAbandoned.WithLabelValues(conn.Mode).Inc()
	x.Log.Warn("KV handoff prepared but never consumed; the prefill frees it on the decode's refusal or at its timeout",
		"connector", conn.Mode, "prefill", pair.Prefill.URL, "decode", pair.Decode.URL, "outcome", outcome)
}

// concurrentMooncake sends both Mooncake legs at once: the decode waits for the KV the prefill
// pushes under the minted transfer id.
func (x *Sequential) concurrentMooncake(rw http.ResponseWriter, r *http.Request, req *Request, pair worker.Pair, plan handoffPlan) error {
	if err := x.report(r, req, pair, plan.conn, HandoffMooncake); err != nil {
		return err
	}
	dBody, err := openai.Set(req.Body, keyKVTransferParams, plan.decodeParams)
	if err != nil {
		return err
	}
	check := &kvCheck{}
	var dHeader http.Header
	dRank := 0
	if rank, ok := pair.Decode.NextRank(); ok {
		dHeader = http.Header{openai.HeaderDPRank: {strconv.Itoa(rank)}}
		dRank = rank + 1
	}
	res := x.Concurrent.run(rw, r, req, pair, concurrentPlan{
		prefillBody: plan.probe, decodeBody: dBody, prefillHeader: plan.prefillHeader, decodeHeader: dHeader,
		prefillRank: plan.prefillRank, decodeRank: dRank,
		dispatch: "concurrent", handoff: HandoffMooncake, connector: ModeMooncake, needPrefill: true,
		check: check,
		rewrite: func(p prefillResult) (func([]byte) []byte, func([]byte) []byte) {
			pu := readPrefillUsage(p.body)
			return checkedEvent(check, pu), checkedBody(req.Rec, check, pu)
		},
	})
	if res.decodeStarted {
		req.Consumed = check.verdict()
	}
	if check.recomputed() {
		x.recomputed(req, pair, ModeMooncake, HandoffMooncake)
		noteHandoff(req.Rec, HandoffRecomputed) // a stream's head left before its usage said so
	}
	if !res.decodeStarted && res.outcome != OutcomePrefillFailed && res.outcome != OutcomeSuccess {
		x.abandoned(plan.conn, pair, res.outcome)
	}
	return res.err
}
