package gateway

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
)

// The Files API (OpenAI's): uploads go to the job store in chunks of
// fileChunk bytes, each its own short write, so that an upload of the
// largest file holds neither its content in memory nor a transaction
// open; downloads read one chunk at a time.

// Limits, as OpenAI's.
const (
	fileChunk         = 1 << 20
	maxBatchFileBytes = 200 << 20 // purpose batch
	maxFileBytes      = 512 << 20 // any other purpose
	maxBatchFileLines = 50_000
	// multipartSlack is room for a multipart body's other parts and
	// boundaries beside its file.
	multipartSlack = 1 << 20
)

var filePurposes = map[string]bool{"assistants": true, "batch": true, "fine-tune": true, "vision": true, "user_data": true, "evals": true}

// batchStore is what the Files and Batch APIs need of the job store.
type batchStore = store.Batches

// fileView is OpenAI's FileObject.
type fileView struct {
	ID            string  `json:"id"`
	Object        string  `json:"object"`
	Bytes         int64   `json:"bytes"`
	CreatedAt     int64   `json:"created_at"`
	ExpiresAt     *int64  `json:"expires_at"`
	Filename      string  `json:"filename"`
	Purpose       string  `json:"purpose"`
	Status        string  `json:"status"`
	StatusDetails *string `json:"status_details"`
}

func fileViewOf(f store.File) fileView {
	v := fileView{ID: f.ID, Object: "file", Bytes: f.Bytes, CreatedAt: f.CreatedAt.Unix(), Filename: f.Filename,
		Purpose: f.Purpose, Status: "processed"}
	if !f.ExpiresAt.IsZero() {
		v.ExpiresAt = unixPtr(f.ExpiresAt)
	}
	return v
}

func unixPtr(t time.Time) *int64 {
	if t.IsZero() {
		return nil
	}
	u := t.Unix()
	return &u
}

// newObjectID is an OpenAI-style id: prefix and a UUIDv7 in hex, so that
// ids sort by creation.
// batchFileExpiry is how long a batch input file uploaded without
// expires_after is kept: OpenAI's default.
const batchFileExpiry = 30 * 24 * time.Hour

func newObjectID(prefix string) string {
	u := uuid.Must(uuid.NewV7())
	return prefix + strings.ReplaceAll(u.String(), "-", "")
}

type rawBodyKey struct{}

// fullBody lets an upload route read past MaxBodyBytes: api caps every
// body, and the upload applies its own, larger, cap instead.
func fullBody(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), rawBodyKey{}, r.Body)))
	})
}

func (s *Server) fileRoutes() {
	s.mux.Handle("POST /v1/files", fullBody(s.api("/v1/files", s.handleUploadFile)))
	s.mux.Handle("GET /v1/files", s.api("/v1/files", s.handleListFiles))
	s.mux.Handle("GET /v1/files/{id}", s.api("/v1/files/{id}", s.handleGetFile))
	s.mux.Handle("GET /v1/files/{id}/content", s.api("/v1/files/{id}/content", s.handleFileContent))
	s.mux.Handle("DELETE /v1/files/{id}", s.api("/v1/files/{id}", s.handleDeleteFile))
}

// fileMax is the largest upload, in bytes: of purpose batch, and of any.
type fileMax struct{ batch, any int64 }

func fileNotFound(id string) error {
	return &apiError{status: http.StatusNotFound, typ: "invalid_request_error", param: "id",
		msg: fmt.Sprintf("No such File object: %s", id)}
}

// DefaultTenantFileBytes is Config.TenantFileBytes's default: what one
// tenant's files may hold together, OpenAI's per-organization figure.
const DefaultTenantFileBytes = 100 << 30

// tenantFileBytes is what one tenant's files may hold together.
func (s *Server) tenantFileBytes() int64 {
	return cmp.Or(s.cfg.TenantFileBytes, DefaultTenantFileBytes)
}

// storageFull refuses an upload that would take a tenant's files past
// what they may hold together.
func storageFull(used, limit int64) error {
	return &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "storage_limit_exceeded", param: "file",
		msg: fmt.Sprintf("Your files hold %d of the %d bytes your tenant may store, and this upload would pass that: delete files you no longer need (DELETE /v1/files/{id}) and try again.", used, limit)}
}

func tooLargeFile(limit int64) error {
	return &apiError{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error", code: "file_too_large", param: "file",
		msg: fmt.Sprintf("The file is larger than the %d MB allowed for its purpose.", limit>>20)}
}

// fileCounter counts a file's bytes and its lines that hold more than
// white space, as the bytes stream past.
type fileCounter struct {
	bytes, lines int64
	inLine       bool // the current line has a non-space byte
}

func (c *fileCounter) Write(p []byte) {
	c.bytes += int64(len(p))
	for _, b := range p {
		switch b {
		case '\n':
			if c.inLine {
				c.lines++
			}
			c.inLine = false
		case ' ', '\t', '\r':
		default:
			c.inLine = true
		}
	}
}

func (c *fileCounter) end() int64 {
	if c.inLine {
		return c.lines + 1
	}
	return c.lines
}

func (s *Server) handleUploadFile(w http.ResponseWriter, r *http.Request) int {
	tenant := tenantOf(r.Context())
	if raw, ok := r.Context().Value(rawBodyKey{}).(io.ReadCloser); ok {
		r.Body = http.MaxBytesReader(w, raw, s.fileMax.any+multipartSlack)
	}
	mr, err := r.MultipartReader()
	if err != nil {
		return writeError(w, s.log, badRequest("", "POST /v1/files takes a multipart/form-data body with the fields file and purpose."))
	}
	var (
		purpose, anchor, seconds string
		file                     *store.File
		counted                  fileCounter
	)
	// An upload that fails leaves no file behind, whatever cut it short.
	cleanup := context.WithoutCancel(r.Context())
	abandon := func(err error) int {
		if file != nil {
			_ = s.batches.DeleteFile(cleanup, tenant, file.ID)
		}
		if errors.Is(context.Cause(r.Context()), errDrainDeadline) {
			// The drain's deadline cut the upload: the client, still
			// sending, is told to retry (on another replica), and no
			// more of its body is read.
			w.Header().Set("Connection", "close")
			err = errDrainDeadline
		}
		return writeError(w, s.log, err)
	}
	for {
		part, err := mr.NextPart()
		if err == io.EOF { // the closing boundary; a body cut short wraps io.EOF
			break
		}
		if err != nil {
			return abandon(s.uploadError(bodyError{err}))
		}
		switch part.FormName() {
		case "purpose":
			purpose, err = formValue(part)
		case "expires_after[anchor]":
			anchor, err = formValue(part)
		case "expires_after[seconds]":
			seconds, err = formValue(part)
		case "file":
			if file != nil {
				err = badRequest("file", "Send one file per upload.")
				break
			}
			file = &store.File{ID: newObjectID("file-"), Tenant: tenant, Filename: part.FileName(), Purpose: purpose, CreatedAt: time.Now()}
			if file.Filename == "" {
				file.Filename = "upload"
			}
			if len(file.Filename) > 255 {
				err = badRequest("file", "The file's name is longer than 255 bytes.")
				file = nil
				break
			}
			if !storableText(file.Filename) || strings.ContainsFunc(file.Filename, unicode.IsControl) {
				err = badRequest("file", "The file's name must be UTF-8 text without control characters.")
				file = nil
				break
			}
			// A purpose sent before the file is checked before the
			// file is stored, not after (the Python SDK sends it first).
			if purpose != "" {
				if err = checkPurpose(purpose, file.Filename); err != nil {
					file = nil
					break
				}
			}
			// What the tenant's files hold already bounds this one: an
			// upload that would pass the tenant's storage is refused as
			// it passes it, not stored whole first.
			var used int64
			if used, err = s.batches.FileBytes(r.Context(), tenant, file.CreatedAt); err != nil {
				file = nil
				break
			}
			room := s.tenantFileBytes() - used
			if room <= 0 {
				err, file = storageFull(used, s.tenantFileBytes()), nil
				break
			}
			if err = s.batches.CreateFile(r.Context(), *file); err != nil {
				file = nil
				break
			}
			// A purpose sent before the file bounds it at once; sent
			// after (as the Node SDK does), at the end.
			limit, over := s.fileMax.any, tooLargeFile(s.fileMax.any)
			if purpose == "batch" {
				limit, over = s.fileMax.batch, tooLargeFile(s.fileMax.batch)
			}
			if room < limit {
				limit, over = room, storageFull(used, s.tenantFileBytes())
			}
			err = s.storeChunks(r.Context(), file.ID, part, &counted, limit, over)
		default:
			if _, cerr := io.Copy(io.Discard, io.LimitReader(part, multipartSlack)); cerr != nil {
				err = bodyError{cerr}
			}
		}
		// The rest of a refused part is read, not stored (up to the body's
		// limit), so that a client still sending hears the answer rather
		// than a reset connection, which SDKs retry; not once the request
		// has ended (a drain's deadline must not wait for the body).
		if r.Context().Err() == nil {
			part.Close()
		}
		if err != nil {
			return abandon(s.uploadError(err))
		}
	}
	switch {
	case file == nil:
		return abandon(badRequest("file", "Missing required parameter: 'file'."))
	case purpose == "":
		return abandon(badRequest("purpose", "Missing required parameter: 'purpose'."))
	}
	if err := checkPurpose(purpose, file.Filename); err != nil {
		return abandon(err)
	}
	file.Purpose = purpose
	lines := counted.end()
	if purpose == "batch" {
		switch {
		case counted.bytes > s.fileMax.batch:
			return abandon(tooLargeFile(s.fileMax.batch))
		case lines > maxBatchFileLines:
			return abandon(badRequest("file", fmt.Sprintf("The file has %d requests; a batch holds at most %d.", lines, maxBatchFileLines)))
		case counted.bytes == 0:
			return abandon(badRequest("file", "The file is empty."))
		}
	}
	if anchor != "" || seconds != "" {
		n, err := strconv.Atoi(seconds)
		if anchor != "created_at" || err != nil || n < 3600 || n > 2592000 {
			return abandon(badRequest("expires_after", "expires_after takes anchor 'created_at' and seconds from 3600 to 2592000."))
		}
		file.ExpiresAt = file.CreatedAt.Add(time.Duration(n) * time.Second)
	} else if purpose == "batch" {
		// OpenAI's default: a batch's input file expires after 30 days,
		// any other file stays until deleted.
		file.ExpiresAt = file.CreatedAt.Add(batchFileExpiry)
	}
	// Uploads at once each saw the room as it was when they began: at its
	// end an upload counts them all (their chunks so far, and those that
	// ended), so that together they do not pass the tenant's storage.
	if used, err := s.batches.FileBytes(r.Context(), file.Tenant, time.Now()); err != nil {
		return abandon(err)
	} else if used > s.tenantFileBytes() {
		return abandon(storageFull(used-counted.bytes, s.tenantFileBytes()))
	}
	// The purpose and expiry may come after the file's part: recorded
	// with its completion.
	file.Bytes, file.Lines, file.Complete = counted.bytes, lines, true
	if err := s.batches.CompleteFile(r.Context(), *file); err != nil {
		return abandon(err)
	}
	writeJSON(w, http.StatusOK, fileViewOf(*file))
	return http.StatusOK
}

// storeChunks writes a file part to the store chunk by chunk, one buffer
// reused, counting it; it stops past limit bytes. The part ends at io.EOF
// alone: a body cut short before the part's boundary
// (io.ErrUnexpectedEOF from the multipart reader) fails it.
func (s *Server) storeChunks(ctx context.Context, id string, part io.Reader, c *fileCounter, limit int64, over error) error {
	buf := make([]byte, fileChunk)
	for seq := 0; ; seq++ {
		n, err := 0, error(nil)
		for n < len(buf) && err == nil {
			var m int
			m, err = part.Read(buf[n:])
			n += m
		}
		if n > 0 {
			c.Write(buf[:n])
			if c.bytes > limit {
				return over
			}
			if werr := s.batches.PutFileChunk(ctx, id, seq, buf[:n]); werr != nil {
				return werr
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return bodyError{err}
		}
	}
}

// bodyError is a failure to read the upload's body: the client's (or
// its connection's), where the store's failures are the server's.
type bodyError struct{ err error }

func (e bodyError) Error() string { return e.err.Error() }
func (e bodyError) Unwrap() error { return e.err }

// uploadError names what went wrong with an upload's body; any other
// failure (the store's) goes to the error table as it is.
func (s *Server) uploadError(err error) error {
	var maxBytes *http.MaxBytesError
	var body bodyError
	switch {
	case errors.As(err, &maxBytes):
		return tooLargeFile(s.fileMax.any)
	case errors.As(err, &body):
		return badRequest("file", "The multipart body could not be read: "+body.err.Error())
	}
	return err
}

// checkPurpose refuses a purpose OpenAI does not have, and a batch's
// input file not named .jsonl.
func checkPurpose(purpose, filename string) error {
	switch {
	case !filePurposes[purpose]:
		return badRequest("purpose", fmt.Sprintf("'%s' is not one of ['assistants', 'batch', 'fine-tune', 'vision', 'user_data', 'evals'] - 'purpose'.", purpose))
	case purpose == "batch" && !strings.HasSuffix(strings.ToLower(filename), ".jsonl"):
		return badRequest("file", "Invalid file format for Batch API. Must be .jsonl")
	}
	return nil
}

func formValue(p *multipart.Part) (string, error) {
	b, err := io.ReadAll(io.LimitReader(p, 1024))
	if err != nil {
		err = bodyError{err}
	}
	return string(bytes.TrimSpace(b)), err
}

func (s *Server) handleGetFile(w http.ResponseWriter, r *http.Request) int {
	f, err := s.batches.File(r.Context(), tenantOf(r.Context()), r.PathValue("id"), time.Now())
	if errors.Is(err, store.ErrNotFound) {
		err = fileNotFound(r.PathValue("id"))
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusOK, fileViewOf(f))
	return http.StatusOK
}

func (s *Server) handleDeleteFile(w http.ResponseWriter, r *http.Request) int {
	tenant, id := tenantOf(r.Context()), r.PathValue("id")
	if _, err := s.batches.File(r.Context(), tenant, id, time.Now()); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			err = fileNotFound(id)
		}
		return writeError(w, s.log, err)
	}
	if err := s.batches.DeleteFile(r.Context(), tenant, id); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			err = fileNotFound(id)
		}
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusOK, struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Deleted bool   `json:"deleted"`
	}{id, "file", true})
	return http.StatusOK
}

// cursorPage is OpenAI's cursor-paged list.
type cursorPage[T any] struct {
	Object  string  `json:"object"`
	Data    []T     `json:"data"`
	FirstID *string `json:"first_id"`
	LastID  *string `json:"last_id"`
	HasMore bool    `json:"has_more"`
}

func pageOf[T any](data []T, id func(T) string, more bool) cursorPage[T] {
	p := cursorPage[T]{Object: "list", Data: data, HasMore: more}
	if p.Data == nil {
		p.Data = []T{}
	}
	if len(data) > 0 {
		first, last := id(data[0]), id(data[len(data)-1])
		p.FirstID, p.LastID = &first, &last
	}
	return p
}

func (s *Server) handleListFiles(w http.ResponseWriter, r *http.Request) int {
	q := r.URL.Query()
	f := store.FileFilter{Purpose: q.Get("purpose"), After: q.Get("after")}
	var err error
	if f.Limit, err = pageSize(r, 10000, 10000); err != nil {
		return writeError(w, s.log, err)
	}
	switch q.Get("order") {
	case "", "desc":
	case "asc":
		f.Asc = true
	default:
		return writeError(w, s.log, badRequest("order", "order must be asc or desc."))
	}
	files, more, err := s.batches.ListFiles(r.Context(), tenantOf(r.Context()), f, time.Now())
	if err != nil {
		return writeError(w, s.log, err)
	}
	views := make([]fileView, len(files))
	for i, fl := range files {
		views[i] = fileViewOf(fl)
	}
	writeJSON(w, http.StatusOK, pageOf(views, func(v fileView) string { return v.ID }, more))
	return http.StatusOK
}

func (s *Server) handleFileContent(w http.ResponseWriter, r *http.Request) int {
	id := r.PathValue("id")
	f, err := s.batches.File(r.Context(), tenantOf(r.Context()), id, time.Now())
	if errors.Is(err, store.ErrNotFound) {
		err = fileNotFound(id)
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	first, err := s.batches.FileChunk(r.Context(), f.ID, 0)
	if err != nil && !errors.Is(err, store.ErrNotFound) {
		return writeError(w, s.log, err)
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(f.Bytes, 10))
	w.Header().Set("Content-Disposition", fmt.Sprintf("attachment; filename=%q", f.Filename))
	w.WriteHeader(http.StatusOK)
	chunk := first
	for seq := 1; len(chunk) > 0; seq++ {
		if _, err := w.Write(chunk); err != nil {
			return http.StatusOK // the client went away
		}
		chunk, err = s.batches.FileChunk(r.Context(), f.ID, seq)
		if err != nil && !errors.Is(err, store.ErrNotFound) {
			// The status line is out: cut the body short of its length,
			// which the client sees as an error.
			s.log.Warn("file download cut", "file", f.ID, "err", err)
			panic(http.ErrAbortHandler)
		}
	}
	return http.StatusOK
}
