// Package epp serves the Endpoint Picker Protocol (Gateway API Inference Extension, v1.0.0):
// Envoy's external-processing gRPC service, through which a Gateway API implementation asks,
// for each request, which model server endpoint serves it. The protocol is this package's;
// the choice is a Picker's (Baton's routing, in internal/server).
//
// One ext_proc stream is one HTTP request. In the full-duplex streamed mode the proxy sends
// the request headers, the body in chunks and its end; the picker answers the headers only once
// it has read the whole body (model and prompt), then hands the body back unchanged. On the
// response path the headers are acknowledged and every body chunk is relayed untouched, read on
// the way for the time of its first byte and the usage the engine reports.
package epp

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/baton-llm/baton/internal/openai"
)

// The protocol's names (004-endpoint-picker-protocol, v1.0.0), and llm-d's header naming the
// prefill endpoint of a disaggregated request.
const (
	HeaderDestination = "x-gateway-destination-endpoint"
	HeaderPrefiller   = openai.HeaderPrefiller
	// HeaderDPRank pins a vLLM request to a data parallel rank: Baton's to set, never a client's.
	HeaderDPRank = "x-data-parallel-rank"
	// MetadataNamespace holds the pick in the response's dynamic metadata, and the endpoint
	// that served in the response path's metadata context.
	MetadataNamespace = "envoy.lb"
	ServedKey         = "x-gateway-destination-endpoint-served"
	// SubsetNamespace and SubsetKey hold the proxy's subset hint in the request's metadata.
	SubsetNamespace = "envoy.lb.subset_hint"
	SubsetKey       = "x-gateway-destination-endpoint-subset"
)

// Request is what the proxy told of one HTTP request.
type Request struct {
	Method, Path string
	Header       http.Header
	// Body is the whole request body: empty for a request known to have none, nil when the
	// pick is made before the body came (the proxy's filter does not stream it first). It is
	// the exchange's: a Picker reads it during Pick only (the exchange lets it go after).
	Body []byte
	// Subset, when HasSubset, is the proxy's subset hint: pick only from these ip:port.
	Subset    []string
	HasSubset bool
}

// Pick is a Picker's choice for one request.
type Pick struct {
	// Endpoints are ip:port, the first the choice, the rest the fallbacks in order.
	Endpoints []string
	// Prefill, for a disaggregated request, is the prefill endpoint (ip:port): the decode-side
	// sidecar runs the prefill leg there.
	Prefill string
	// Body, when set, replaces the request body (the model renamed to the workers' name for
	// it); nil sends the body as the client sent it.
	Body []byte
	// Served learns the endpoint the proxy reports served the request ("" when it does not).
	Served func(endpoint string)
	// Done is called once, when the exchange ended.
	Done func(Outcome)
}

// Outcome is what the response path showed of one request.
type Outcome struct {
	Status     int       // the response's status; 0 when none came (the stream ended first)
	FirstByte  time.Time // the first response body byte; zero when none
	Usage      openai.Usage
	UsageKnown bool
	Bytes      int64 // response body bytes relayed
	// Err is why the exchange ended early ("" when it ended with the response): the proxy
	// cancelled, or broke the protocol.
	Err string
}

// Picker chooses the endpoints of a request. An *openai.Error refuses it: the proxy answers
// the client that error (status, OpenAI envelope) in place of any endpoint.
type Picker interface {
	Pick(ctx context.Context, req *Request) (*Pick, error)
}

// Server is the ext_proc ExternalProcessor service.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	Picker Picker
	// MaxBody bounds a request body assembled from its chunks: past it the request is refused
	// 413 before any endpoint is chosen.
	MaxBody int64
	// MaxHeaderBytes bounds the request headers the proxy sends (names and values); maxHeaders
	// bounds their number.
	MaxHeaderBytes int
	// Reserve and Release hold request body bytes in the process-wide budget the HTTP
	// listener's bodies share (nil: none): a body past it is refused 503. A chunk's bytes are
	// charged before they are copied into the body: one that finds no room is never held.
	Reserve func(n int64) bool
	Release func(n int64)
	// MaxDuration bounds one exchange, request and response (0: unbounded): past it the
	// stream ends and the request with it.
	MaxDuration time.Duration
	Log         *slog.Logger
	// Observe, when set, sees each request's refusal code ("" for a pick) and how long the
	// choice took from the last byte of the body.
	Observe func(code string, d time.Duration)
	// MaxStreams bounds the exchanges served at once, over every connection (0: unbounded):
	// past it a new stream ends at once with RESOURCE_EXHAUSTED.
	MaxStreams int
	// RequestPhase bounds the request path of one exchange, from the stream's start to the
	// pick or refusal (headers and body in): past it the stream ends with DEADLINE_EXCEEDED.
	// A data plane that opens streams and sends nothing, or a body that never ends, holds
	// nothing longer than this.
	RequestPhase time.Duration
	// Cut, when set, counts a stream the picker refused or ended for its data plane's
	// behaviour: "max_streams" or "request_phase_timeout".
	Cut func(reason string)
	// Streams, when set, follows the exchanges being served.
	Streams interface{ Add(float64) }
	// Owned, when set, names a field of a request body that only Baton may set (kv_transfer_params,
	// bootstrap_*, priority, ...), "" for none: in a mode where the picker cannot edit the body
	// (STREAMED, after the pick), a body carrying one is refused at its end.
	Owned func(body []byte) string
	// Guarded, when set, reports whether a request's body must be read for owned fields (an
	// inference route): with request_body_mode NONE, where no body ever reaches the picker,
	// such a request with a body is refused.
	Guarded func(method, path string) bool

	warned   atomic.Bool  // the headers-only warning was logged
	active   atomic.Int64 // exchanges being served
	peak     atomic.Int64 // the most exchanges at once since memory was last given back
	released atomic.Int64 // when memory was last given back (Unix nanoseconds)
	freed    atomic.Int64 // body bytes let go since then
}

// A burst of at least burstStreams exchanges that ended gives the memory it took back to the
// system (at most once per releaseEvery): a flood's memory does not stay with the process until
// the runtime's own pace returns it.
const (
	burstStreams = 512
	burstBytes   = 64 << 20
	releaseEvery = 30 * time.Second
	releaseDelay = 3 * time.Second
)

// ended notes an exchange's end, and gives memory back after a burst: of at least burstStreams
// exchanges (or half of MaxStreams, when lower), or of burstBytes of bodies let go.
func (s *Server) ended() {
	n := s.active.Add(-1)
	burst := int64(burstStreams)
	if s.MaxStreams > 0 {
		burst = min(burst, max(int64(s.MaxStreams)/2, 8))
	}
	bodies := s.freed.Load() >= burstBytes
	if p := s.peak.Load(); (p-n < burst || n > p/4) && !bodies {
		return
	}
	now := time.Now().UnixNano()
	if last := s.released.Load(); now-last < int64(releaseEvery) || !s.released.CompareAndSwap(last, now) {
		return
	}
	s.peak.Store(n)
	s.freed.Store(0)
	// A little later: the burst's last streams and their connections end first.
	time.AfterFunc(releaseDelay, func() {
		// Twice: what the first collection moved to the pools' victim caches goes with the second.
		debug.FreeOSMemory()
		debug.FreeOSMemory()
	})
}

// started notes an exchange's start and returns how many are served.
func (s *Server) started() int64 {
	n := s.active.Add(1)
	for p := s.peak.Load(); n > p && !s.peak.CompareAndSwap(p, n); p = s.peak.Load() {
	}
	return n
}

// Active is the number of exchanges being served.
func (s *Server) Active() int64 { return s.active.Load() }

// chunkSize is the largest body chunk handed back in one message: well below gRPC's default
// 4 MiB message bound on both sides.
const chunkSize = 1 << 20

// maxHeaders bounds the request header fields the proxy sends.
const maxHeaders = 256

// maxTail is the response bytes kept to read the usage from once the response ended.
const maxTail = 16 << 10

// errProtocol is a message the protocol does not allow where it came.
var errProtocol = errors.New("ext_proc message out of order")

// Process serves one ext_proc stream: one HTTP request, for MaxDuration at most, its request
// path for RequestPhase at most, while fewer than MaxStreams others are served.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	if n := s.started(); s.MaxStreams > 0 && n > int64(s.MaxStreams) {
		s.ended()
		s.cut("max_streams")
		return status.Errorf(codes.ResourceExhausted, "the Endpoint Picker serves %d exchanges at once (epp_max_streams)", s.MaxStreams)
	}
	defer s.ended()
	if s.Streams != nil {
		s.Streams.Add(1)
		defer s.Streams.Add(-1)
	}
	x := s.newExchange(stream)
	if s.MaxDuration <= 0 && s.RequestPhase <= 0 {
		return x.serve()
	}
	res := make(chan error, 1)
	go func() { res <- x.serve() }()
	var whole, phase <-chan time.Time
	if s.MaxDuration > 0 {
		t := time.NewTimer(s.MaxDuration)
		defer t.Stop()
		whole = t.C
	}
	if s.RequestPhase > 0 {
		t := time.NewTimer(s.RequestPhase)
		defer t.Stop()
		phase = t.C
	}
	for {
		// Returning ends the stream: serve's receive fails and the request ends with it.
		select {
		case err := <-res:
			return err
		case <-phase:
			if !x.whole.Load() {
				s.cut("request_phase_timeout")
				return status.Errorf(codes.DeadlineExceeded, "the request was not whole within %s (body_timeout)", s.RequestPhase)
			}
			phase = nil
		case <-whole:
			s.cut("max_duration")
			return status.Errorf(codes.DeadlineExceeded, "the exchange outlived %s", s.MaxDuration)
		}
	}
}

func (s *Server) cut(reason string) {
	if s.Cut != nil {
		s.Cut(reason)
	}
}

func (s *Server) newExchange(stream extprocv3.ExternalProcessor_ProcessServer) *exchange {
	return &exchange{s: s, stream: stream, ctx: stream.Context(), reqMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		respMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}
}

// serve runs one stream's exchange until it ends.
func (x *exchange) serve() error {
	defer x.end()
	for {
		m, err := x.stream.Recv()
		if err == io.EOF {
			return nil
		}
		if status.Code(err) == codes.ResourceExhausted {
			// A message past the server's MaxRecvMsgSize (MessageBound), refused before it was
			// read: gRPC has ended the stream with that status.
			x.err = err.Error()
			return err
		}
		if err != nil {
			x.err = "the proxy ended the stream: " + status.Code(err).String()
			return nil
		}
		if err := x.handle(m); err != nil {
			if x.err = err.Error(); errors.Is(err, errProtocol) {
				return status.Error(codes.InvalidArgument, x.err)
			}
			return err
		}
		if x.immediate {
			// An immediate response ends the exchange (the proxy answers the client with it):
			// the stream is not held open for a peer that would keep it.
			return nil
		}
	}
}

// exchange is the state of one stream.
type exchange struct {
	s      *Server
	stream extprocv3.ExternalProcessor_ProcessServer
	ctx    context.Context

	reqMode, respMode filterv3.ProcessingMode_BodySendMode
	observability     bool
	started           bool // the request headers came
	answered          bool // the request path was answered (pick or refusal)
	watchBody         bool // picked before a STREAMED body: read it for owned fields
	// whole: the request path is over — answered, and its body (when one passes the picker)
	// ended — as Process's request-phase timer reads it. A STREAMED body that comes after the
	// pick keeps the phase open until its end.
	whole     atomic.Bool
	req       Request
	body      []byte
	held      int64 // body bytes reserved in the budget
	bodyDone  bool
	pick      *Pick
	immediate bool

	out      Outcome
	tail     []byte
	respDone bool
	err      string
}

// dropBody lets the request body go once it was handed back (or refused), and gives its bytes
// back to the budget: a long response holds none of it.
func (x *exchange) dropBody() {
	x.body, x.req.Body = nil, nil
	if x.held > 0 && x.s.Release != nil {
		x.s.Release(x.held)
	}
	x.s.freed.Add(x.held)
	x.held = 0
}

// end reports the outcome (once: serve defers it), and gives the body's bytes back to the
// budget.
func (x *exchange) end() {
	x.dropBody()
	if x.pick == nil || x.pick.Done == nil {
		return
	}
	if !x.respDone {
		x.out.Err = cmp.Or(x.err, "the proxy ended the stream before the response did")
	}
	if u, ok := openai.LastUsage(x.tail); ok {
		x.out.Usage, x.out.UsageKnown = u, true
	}
	x.pick.Done(x.out)
}

func (x *exchange) handle(m *extprocv3.ProcessingRequest) error {
	if pc := m.GetProtocolConfig(); pc != nil && !x.started {
		x.reqMode, x.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
	}
	if m.GetObservabilityMode() {
		x.observability = true // the proxy expects no answer: Baton picks nothing it could apply
	}
	switch r := m.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		if x.started {
			return fmt.Errorf("%w: request headers twice", errProtocol)
		}
		x.started = true
		if err := x.headers(r.RequestHeaders, m.GetMetadataContext()); err != nil || x.answered {
			return err // refused: the immediate response is the only answer
		}
		if r.RequestHeaders.GetEndOfStream() {
			x.bodyDone = true
			return x.decide(true)
		}
		switch x.reqMode {
		case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
			return nil // the answer waits for the body
		case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
			// The headers are answered now; the pick rides on the body's answer.
			return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
				RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}}}})
		default:
			// No body comes before the headers' answer (NONE, STREAMED): the pick is made
			// from the headers alone, without model or prompt.
			x.headersOnly()
			guarded := x.s.Guarded != nil && x.s.Guarded(x.req.Method, x.req.Path)
			if guarded && x.reqMode == filterv3.ProcessingMode_NONE {
				return x.refuse(&openai.Error{Status: http.StatusInternalServerError, Code: openai.CodeBodyUnread,
					Message: "the gateway's ext_proc filter sends the Endpoint Picker no request body (request_body_mode NONE): the fields Baton owns could reach the engines; configure FULL_DUPLEX_STREAMED (or STREAMED)"}, false)
			}
			x.watchBody = guarded && x.reqMode == filterv3.ProcessingMode_STREAMED && x.s.Owned != nil
			return x.decide(true)
		}
	case *extprocv3.ProcessingRequest_RequestBody:
		if !x.started || x.bodyDone {
			return fmt.Errorf("%w: a request body chunk outside the request body", errProtocol)
		}
		b := r.RequestBody
		if x.answered {
			x.bodyDone = b.GetEndOfStream()
			if x.bodyDone {
				x.whole.Store(true)
			}
			if x.immediate || x.reqMode != filterv3.ProcessingMode_STREAMED {
				return nil // refused while the body was still coming: the rest is not read
			}
			if x.watchBody {
				// Picked before the body came: the body cannot be edited, so one carrying a
				// field Baton owns is refused at its end (its last chunk is not let through).
				if e := x.watchChunk(b.GetBody(), x.bodyDone); e != nil {
					return x.refuse(e, false)
				}
			}
			return x.send(bodyAck()) // streamed (half duplex): every chunk is answered
		}
		if e := x.take(b.GetBody()); e != nil {
			return x.refuse(e, false)
		}
		if !b.GetEndOfStream() && x.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
			return nil
		}
		if !b.GetEndOfStream() && x.reqMode == filterv3.ProcessingMode_BUFFERED_PARTIAL {
			// The proxy's buffer filled: the rest of the body goes to the engine unseen, so
			// neither the model nor the fields Baton owns can be read in it.
			return x.refuse(&openai.Error{Status: http.StatusRequestEntityTooLarge, Code: openai.CodePayloadTooLarge,
				Message: "the request body is larger than the gateway's ext_proc buffer (BUFFERED_PARTIAL): raise the filter's buffer, or use FULL_DUPLEX_STREAMED"}, false)
		}
		// The end of the body (a buffered body comes in one message, whole or as much as the
		// proxy buffered).
		x.bodyDone = true
		return x.decide(false)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if !x.started {
			return fmt.Errorf("%w: request trailers before headers", errProtocol)
		}
		if !x.bodyDone && !x.answered {
			x.bodyDone = true
			if err := x.decide(false); err != nil {
				return err
			}
		}
		if !x.bodyDone && x.answered && !x.immediate {
			// The body ended with trailers after the pick (STREAMED): the watched body's end.
			x.bodyDone = true
			x.whole.Store(true)
			if x.watchBody {
				if e := x.watchChunk(nil, true); e != nil {
					return x.refuse(e, false)
				}
			}
		}
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}})
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		if !x.answered || x.immediate {
			return fmt.Errorf("%w: response headers before the request was answered", errProtocol)
		}
		x.served(m.GetMetadataContext())
		for _, h := range r.ResponseHeaders.GetHeaders().GetHeaders() {
			if h.GetKey() == ":status" {
				x.out.Status, _ = strconv.Atoi(headerValue(h))
			}
		}
		if r.ResponseHeaders.GetEndOfStream() {
			x.respDone = true
		}
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
			ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}}}})
	case *extprocv3.ProcessingRequest_ResponseBody:
		if !x.answered || x.immediate {
			return fmt.Errorf("%w: a response body before the request was answered", errProtocol)
		}
		b := r.ResponseBody
		if x.out.FirstByte.IsZero() && len(b.GetBody()) > 0 {
			x.out.FirstByte = time.Now()
		}
		x.out.Bytes += int64(len(b.GetBody()))
		x.keepTail(b.GetBody())
		if b.GetEndOfStream() {
			x.respDone = true
		}
		if x.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
			return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
				Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b.GetBody(), EndOfStream: b.GetEndOfStream()}}}}}}})
		}
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}})
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		x.respDone = true
		return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}})
	default:
		return fmt.Errorf("%w: a message of no known kind", errProtocol)
	}
}

// watchChunk reads one chunk of a body that comes after the pick (STREAMED): the body is held
// (bounded as any body) until its end, then checked for a field Baton owns.
func (x *exchange) watchChunk(chunk []byte, end bool) *openai.Error {
	if e := x.take(chunk); e != nil {
		return e
	}
	if !end {
		return nil
	}
	defer x.dropBody()
	if !openai.Valid(x.body) {
		// A body the guard cannot read could still carry an owned field an engine reads (a
		// byte order mark, UTF-16): refused, as every other mode refuses it.
		return &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeInvalidJSON, Message: "request body is not valid JSON"}
	}
	if f := x.s.Owned(x.body); f != "" {
		return &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeOwnedField, Param: f,
			Message: f + " is a field only Baton sets, and this gateway's ext_proc filter (request_body_mode STREAMED) lets the Endpoint Picker see the body only after it chose: the request is refused rather than sent on with it"}
	}
	return nil
}

// take appends a chunk to the body, bounded by MaxBody. A body that must grow has its new
// buffer charged before anything is copied into it: a chunk that finds no room in the budget
// is refused 503 and never held, and the body is let go.
func (x *exchange) take(chunk []byte) *openai.Error {
	n := len(x.body) + len(chunk)
	if int64(n) > x.s.MaxBody {
		x.dropBody()
		return &openai.Error{Status: http.StatusRequestEntityTooLarge, Code: openai.CodePayloadTooLarge,
			Message: fmt.Sprintf("request body exceeds the limit of %d bytes", x.s.MaxBody)}
	}
	if n > cap(x.body) {
		size := min(max(n, 2*cap(x.body)), int(x.s.MaxBody))
		if x.s.Reserve != nil {
			if !x.s.Reserve(int64(size) - x.held) {
				x.dropBody()
				return &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeOverloaded, RetryAfter: "1",
					Message: "request bodies held at once would exceed max_buffered_body_bytes; try again"}
			}
			x.held = int64(size)
		}
		grown := make([]byte, len(x.body), size)
		copy(grown, x.body)
		x.body = grown
	}
	x.body = append(x.body, chunk...)
	return nil
}

// headersOnly warns, once per process, that the proxy answers the request headers before it
// sends the body, so that picks cannot read the model or the prompt.
func (x *exchange) headersOnly() {
	if x.s.Log != nil && !x.s.warned.Swap(true) {
		x.s.Log.Warn("epp: the proxy sends the request body only after the headers are answered (request_body_mode "+x.reqMode.String()+"): picks see no model and no prompt, and a body carrying a field Baton owns (priority, kv_transfer_params, bootstrap_*) cannot be edited, so it is refused (STREAMED: at its end; NONE: every inference request with a body); configure the ext_proc filter with FULL_DUPLEX_STREAMED",
			"path", x.req.Path)
	}
}

// headers reads the request's pseudo-headers, headers and subset hint.
func (x *exchange) headers(h *extprocv3.HttpHeaders, md *corev3.Metadata) error {
	x.req.Header = http.Header{}
	if n := len(h.GetHeaders().GetHeaders()); n > maxHeaders {
		return x.refuse(&openai.Error{Status: http.StatusRequestHeaderFieldsTooLarge, Code: openai.CodeHeadersTooLarge,
			Message: fmt.Sprintf("the request has %d header fields, above %d", n, maxHeaders)}, false)
	}
	size := 0
	for _, hv := range h.GetHeaders().GetHeaders() {
		k, v := hv.GetKey(), headerValue(hv)
		if size += len(k) + len(v); x.s.MaxHeaderBytes > 0 && size > x.s.MaxHeaderBytes {
			return x.refuse(&openai.Error{Status: http.StatusRequestHeaderFieldsTooLarge, Code: openai.CodeHeadersTooLarge,
				Message: fmt.Sprintf("request headers exceed %d bytes", x.s.MaxHeaderBytes)}, false)
		}
		switch k {
		case ":method":
			x.req.Method = v
		case ":path":
			x.req.Path = v
		default:
			if !strings.HasPrefix(k, ":") {
				x.req.Header.Add(k, v)
			}
		}
	}
	if i := strings.IndexByte(x.req.Path, '?'); i >= 0 {
		x.req.Path = x.req.Path[:i]
	}
	if f := md.GetFilterMetadata()[SubsetNamespace]; f != nil {
		if v, ok := f.GetFields()[SubsetKey]; ok {
			x.req.HasSubset = true
			x.req.Subset = endpointList(v)
		}
	}
	return nil
}

// endpointList reads a subset hint's value: a list of ip:port strings (a string of them,
// comma-separated, is taken too).
func endpointList(v *structpb.Value) []string {
	var out []string
	add := func(s string) {
		for _, e := range strings.Split(s, ",") {
			if e = strings.TrimSpace(e); e != "" {
				out = append(out, e)
			}
		}
	}
	switch k := v.GetKind().(type) {
	case *structpb.Value_ListValue:
		for _, e := range k.ListValue.GetValues() {
			add(e.GetStringValue())
		}
	case *structpb.Value_StringValue:
		add(k.StringValue)
	}
	return out
}

// served tells the pick which endpoint the proxy reports served the request.
func (x *exchange) served(md *corev3.Metadata) {
	if x.pick == nil || x.pick.Served == nil {
		return
	}
	served := ""
	if f := md.GetFilterMetadata()[MetadataNamespace]; f != nil {
		served = strings.TrimSpace(f.GetFields()[ServedKey].GetStringValue())
	}
	x.pick.Served(served)
}

// decide asks the picker for the request's endpoints and answers the request path: in the
// headers' answer when the body is not streamed to Baton (atHeaders) or in full duplex mode,
// else in the buffered body's answer. The body is let go once answered.
func (x *exchange) decide(atHeaders bool) error {
	defer x.dropBody()
	return x.answer(atHeaders)
}

func (x *exchange) answer(atHeaders bool) error {
	if x.answered {
		return nil
	}
	x.req.Body = nil // nil: a pick made before the body came (it may have one)
	if x.bodyDone {
		if x.req.Body = x.body; x.req.Body == nil {
			x.req.Body = []byte{} // known to be empty
		}
	}
	start := time.Now()
	p, err := x.s.Picker.Pick(x.ctx, &x.req)
	if err != nil {
		var oe *openai.Error
		if !errors.As(err, &oe) {
			oe = &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeNoAvailableWorkers, Message: err.Error()}
		}
		if x.s.Observe != nil {
			x.s.Observe(oe.Code, time.Since(start))
		}
		return x.refuse(oe, true)
	}
	if x.s.Observe != nil {
		x.s.Observe("", time.Since(start))
	}
	x.pick, x.answered = p, true
	if x.bodyDone || x.reqMode != filterv3.ProcessingMode_STREAMED {
		x.whole.Store(true) // NONE: no body passes the picker
	}
	if x.observability {
		return nil
	}
	dest := strings.Join(p.Endpoints, ",")
	mut := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setHeader(HeaderDestination, dest)}}
	var bodyMut *extprocv3.BodyMutation
	if p.Body != nil && x.bodyDone {
		x.body = p.Body
		mut.SetHeaders = append(mut.SetHeaders, setHeader("content-length", strconv.Itoa(len(p.Body))))
		bodyMut = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: p.Body}}
	}
	// Headers only Baton sets: a client's own never reaches the engine.
	mut.RemoveHeaders = []string{HeaderDPRank}
	if p.Prefill != "" {
		mut.SetHeaders = append(mut.SetHeaders, setHeader(HeaderPrefiller, p.Prefill))
	} else {
		mut.RemoveHeaders = append(mut.RemoveHeaders, HeaderPrefiller)
	}
	meta := &structpb.Struct{Fields: map[string]*structpb.Value{MetadataNamespace: structpb.NewStructValue(&structpb.Struct{
		Fields: map[string]*structpb.Value{HeaderDestination: structpb.NewStringValue(dest)}})}}
	common := &extprocv3.CommonResponse{HeaderMutation: mut, ClearRouteCache: true}
	duplex := x.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	if atHeaders || duplex {
		if err := x.send(&extprocv3.ProcessingResponse{DynamicMetadata: meta, Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: common}}}); err != nil {
			return err
		}
		if !duplex || atHeaders {
			return nil
		}
		// The body goes back to the proxy unchanged, in chunks a gRPC message holds.
		body := x.body
		for {
			n := min(len(body), chunkSize)
			last := n == len(body)
			if err := x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
				Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body[:n], EndOfStream: last}}}}}}}); err != nil {
				return err
			}
			if body = body[n:]; last {
				return nil
			}
		}
	}
	// Buffered: the body's answer carries the header mutation, and the renamed body if any.
	common.BodyMutation = bodyMut
	return x.send(&extprocv3.ProcessingResponse{DynamicMetadata: meta, Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: common}}})
}

// refuse answers the request with an immediate response in the OpenAI error envelope.
func (x *exchange) refuse(e *openai.Error, picked bool) error {
	if !picked && x.s.Observe != nil {
		x.s.Observe(e.Code, 0)
	}
	x.answered, x.immediate = true, true
	x.whole.Store(true)
	hm := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
		setHeader("content-type", "application/json"), setHeader(openai.HeaderErrorCode, e.Code)}}
	if e.RetryAfter != "" {
		hm.SetHeaders = append(hm.SetHeaders, setHeader("retry-after", e.RetryAfter))
	}
	if x.s.Log != nil {
		x.s.Log.Debug("epp: request refused", "status", e.Status, "code", e.Code, "path", x.req.Path)
	}
	return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
		Status: &typev3.HttpStatus{Code: typev3.StatusCode(e.Status)}, Headers: hm, Body: e.Marshal(), Details: "baton_" + e.Code}}})
}

func (x *exchange) send(r *extprocv3.ProcessingResponse) error {
	if x.observability {
		return nil
	}
	return x.stream.Send(r)
}

// keepTail keeps the last maxTail bytes of the response body.
func (x *exchange) keepTail(b []byte) {
	if len(b) >= maxTail {
		x.tail = append(x.tail[:0], b[len(b)-maxTail:]...)
		return
	}
	if over := len(x.tail) + len(b) - maxTail; over > 0 {
		x.tail = append(x.tail[:0], x.tail[over:]...)
	}
	x.tail = append(x.tail, b...)
}

// bodyAck answers one streamed request body chunk unchanged.
func bodyAck() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}}
}

func setHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
}

// headerValue is a header's value: Envoy sends it in raw_value, older proxies in value.
func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}
