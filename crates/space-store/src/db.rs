//! The SQL the store speaks, to either database: SQLite (the embedded
//! default, one file in the data dir) or PostgreSQL (cluster mode). Store
//! code writes each statement once, with `?N` placeholders and SQL both
//! dialects share, inside [`Db::tx`]; values cross as [`Value`]s.

use std::sync::Mutex;

use crate::StoreError;

/// A value bound to a statement or read from a row.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Int(i64),
    Text(String),
    Bytes(Vec<u8>),
}

impl From<&str> for Value {
    fn from(text: &str) -> Value {
        Value::Text(text.to_string())
    }
}

impl From<String> for Value {
    fn from(text: String) -> Value {
        Value::Text(text)
    }
}

impl From<space_api::Timestamp> for Value {
    fn from(time: space_api::Timestamp) -> Value {
        Value::Text(time.to_string())
    }
}

impl From<&String> for Value {
    fn from(text: &String) -> Value {
        Value::Text(text.clone())
    }
}

impl From<i64> for Value {
    fn from(n: i64) -> Value {
        Value::Int(n)
    }
}

impl From<u64> for Value {
    fn from(n: u64) -> Value {
        Value::Int(n.min(i64::MAX as u64) as i64)
    }
}

impl From<u32> for Value {
    fn from(n: u32) -> Value {
        Value::Int(i64::from(n))
    }
}

impl From<&[u8]> for Value {
    fn from(bytes: &[u8]) -> Value {
        Value::Bytes(bytes.to_vec())
    }
}

impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(value: Option<T>) -> Value {
        value.map(Into::into).unwrap_or(Value::Null)
    }
}

/// `vals![a, b]`: the values of a statement's placeholders, in order.
macro_rules! vals {
    ($($value:expr),* $(,)?) => { &[$($crate::db::Value::from($value)),*] };
}
pub(crate) use vals;

/// One row of a query's answer.
#[derive(Debug)]
pub struct Row(Vec<Value>);

impl Row {
    fn at(&self, i: usize) -> Result<&Value, StoreError> {
        self.0.get(i).ok_or_else(|| StoreError::Shape(format!("no column {i}")))
    }

    pub fn text(&self, i: usize) -> Result<String, StoreError> {
        self.opt_text(i)?.ok_or_else(|| StoreError::Shape(format!("column {i} is null")))
    }

    pub fn opt_text(&self, i: usize) -> Result<Option<String>, StoreError> {
        match self.at(i)? {
            Value::Text(text) => Ok(Some(text.clone())),
            Value::Null => Ok(None),
            other => Err(StoreError::Shape(format!("column {i} is not text: {other:?}"))),
        }
    }

    pub fn int(&self, i: usize) -> Result<i64, StoreError> {
        match self.at(i)? {
            Value::Int(n) => Ok(*n),
            other => Err(StoreError::Shape(format!("column {i} is not a number: {other:?}"))),
        }
    }

    pub fn opt_int(&self, i: usize) -> Result<Option<i64>, StoreError> {
        match self.at(i)? {
            Value::Null => Ok(None),
            _ => self.int(i).map(Some),
        }
    }

    pub fn bytes(&self, i: usize) -> Result<Vec<u8>, StoreError> {
        match self.at(i)? {
            Value::Bytes(bytes) => Ok(bytes.clone()),
            other => Err(StoreError::Shape(format!("column {i} is not bytes: {other:?}"))),
        }
    }
}

/// Statements inside one transaction.
pub trait Conn {
    /// Runs a statement; the rows it changed.
    fn execute(&mut self, sql: &str, values: &[Value]) -> Result<u64, StoreError>;
    /// Runs a query; every row.
    fn query(&mut self, sql: &str, values: &[Value]) -> Result<Vec<Row>, StoreError>;
    /// Runs a script of statements without values (a migration).
    fn batch(&mut self, sql: &str) -> Result<(), StoreError>;
    /// Whether this is PostgreSQL (some statements exist in one dialect only).
    fn postgres(&self) -> bool {
        false
    }

    /// The first row of a query, if any.
    fn query_one(&mut self, sql: &str, values: &[Value]) -> Result<Option<Row>, StoreError> {
        Ok(self.query(sql, values)?.into_iter().next())
    }
}

/// Which database, and the connections to it.
pub enum Db {
    Sqlite(Mutex<rusqlite::Connection>),
    Postgres(Postgres),
}

impl Db {
    /// Runs `work` in one transaction: committed if it returns Ok, rolled
    /// back otherwise.
    pub fn tx<T>(&self, work: impl FnOnce(&mut dyn Conn) -> Result<T, StoreError>) -> Result<T, StoreError> {
        match self {
            Db::Sqlite(conn) => {
                let mut conn = conn.lock().unwrap_or_else(|e| e.into_inner());
                let tx = conn.transaction()?;
                let result = work(&mut SqliteConn(&tx))?;
                tx.commit()?;
                Ok(result)
            }
            Db::Postgres(pg) => pg.tx(work),
        }
    }
}

/// A SQLite connection, or a transaction of one.
pub struct SqliteConn<'a>(pub &'a rusqlite::Connection);

fn to_sqlite(value: &Value) -> rusqlite::types::Value {
    match value {
        Value::Null => rusqlite::types::Value::Null,
        Value::Int(n) => rusqlite::types::Value::Integer(*n),
        Value::Text(text) => rusqlite::types::Value::Text(text.clone()),
        Value::Bytes(bytes) => rusqlite::types::Value::Blob(bytes.clone()),
    }
}

impl Conn for SqliteConn<'_> {
    fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        Ok(self.0.execute_batch(sql)?)
    }

    fn execute(&mut self, sql: &str, values: &[Value]) -> Result<u64, StoreError> {
        let mut statement = self.0.prepare_cached(sql)?;
        Ok(statement.execute(rusqlite::params_from_iter(values.iter().map(to_sqlite)))? as u64)
    }

    fn query(&mut self, sql: &str, values: &[Value]) -> Result<Vec<Row>, StoreError> {
        let mut statement = self.0.prepare_cached(sql)?;
        let columns = statement.column_count();
        let rows = statement.query_map(rusqlite::params_from_iter(values.iter().map(to_sqlite)), |r| {
            (0..columns)
                .map(|i| {
                    Ok(match r.get_ref(i)? {
                        rusqlite::types::ValueRef::Null => Value::Null,
                        rusqlite::types::ValueRef::Integer(n) => Value::Int(n),
                        rusqlite::types::ValueRef::Real(x) => Value::Int(x as i64),
                        rusqlite::types::ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
                        rusqlite::types::ValueRef::Blob(b) => Value::Bytes(b.to_vec()),
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Row)
        })?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }
}

/// A few PostgreSQL connections; a caller takes a free one.
pub struct Postgres {
    clients: Vec<Mutex<postgres::Client>>,
}

impl Drop for Postgres {
    /// A blocking client shuts its own runtime down when dropped, which
    /// tokio forbids inside an async context: they go on a plain thread.
    fn drop(&mut self) {
        let clients = std::mem::take(&mut self.clients);
        let _ = std::thread::spawn(move || drop(clients)).join();
    }
}

/// Connections kept to PostgreSQL per process.
const PG_CONNECTIONS: usize = 4;

impl Postgres {
    pub fn connect(url: &str) -> Result<Postgres, StoreError> {
        let clients = outside_runtime(|| {
            (0..PG_CONNECTIONS)
                .map(|_| postgres::Client::connect(url, postgres::NoTls).map(Mutex::new))
                .collect::<Result<Vec<_>, _>>()
        })?;
        Ok(Postgres { clients })
    }

    fn tx<T>(&self, work: impl FnOnce(&mut dyn Conn) -> Result<T, StoreError>) -> Result<T, StoreError> {
        outside_runtime(|| {
            let mut client = self
                .clients
                .iter()
                .find_map(|c| c.try_lock().ok())
                .unwrap_or_else(|| self.clients[0].lock().unwrap_or_else(|e| e.into_inner()));
            let mut tx = client.transaction()?;
            let result = work(&mut PgConn(&mut tx))?;
            tx.commit()?;
            Ok(result)
        })
    }

    /// Takes the database's one server lock (a session advisory lock, so it
    /// goes when this process's connection does); false if another server
    /// holds it.
    pub fn lock_server(&self) -> Result<bool, StoreError> {
        outside_runtime(|| {
            let row = self.clients[0]
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .query_one("SELECT pg_try_advisory_lock(7270002)", &[])?;
            Ok(row.try_get::<_, bool>(0)?)
        })
    }
}

/// The blocking PostgreSQL client runs a small runtime of its own, which
/// must not start inside an async task: on a worker of a multi-threaded
/// runtime (the server's) the work moves off it first (`block_in_place`);
/// outside any runtime it runs as is. (A single-threaded runtime cannot
/// use this store.)
fn outside_runtime<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// `?N` placeholders as PostgreSQL writes them (`$N`).
fn pg_sql(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '?' && chars.peek().is_some_and(char::is_ascii_digit) {
            out.push('$');
        } else {
            out.push(c);
        }
    }
    out
}

struct PgConn<'a, 'b>(&'a mut postgres::Transaction<'b>);

impl postgres::types::ToSql for Value {
    fn to_sql(
        &self,
        ty: &postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        use postgres::types::Type;
        match self {
            Value::Null => Ok(postgres::types::IsNull::Yes),
            Value::Int(n) => match *ty {
                Type::INT8 => n.to_sql(ty, out),
                Type::INT4 => i32::try_from(*n)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(*n)?.to_sql(ty, out),
                Type::BOOL => (*n != 0).to_sql(ty, out),
                _ => Err(format!("a number bound to a {ty} column").into()),
            },
            Value::Text(text) => text.to_sql(ty, out),
            Value::Bytes(bytes) => bytes.to_sql(ty, out),
        }
    }

    fn accepts(_: &postgres::types::Type) -> bool {
        true
    }

    postgres::types::to_sql_checked!();
}

fn from_pg(row: &postgres::Row, i: usize) -> Result<Value, StoreError> {
    use postgres::types::Type;
    let ty = row.columns()[i].type_().clone();
    let value = match ty {
        Type::INT8 => row.try_get::<_, Option<i64>>(i)?.map(Value::Int),
        Type::INT4 => row.try_get::<_, Option<i32>>(i)?.map(|n| Value::Int(n.into())),
        Type::INT2 => row.try_get::<_, Option<i16>>(i)?.map(|n| Value::Int(n.into())),
        Type::BOOL => row.try_get::<_, Option<bool>>(i)?.map(|b| Value::Int(b.into())),
        Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME => row.try_get::<_, Option<String>>(i)?.map(Value::Text),
        Type::BYTEA => row.try_get::<_, Option<Vec<u8>>>(i)?.map(Value::Bytes),
        other => return Err(StoreError::Shape(format!("column {i} has type {other}, which the store does not read"))),
    };
    Ok(value.unwrap_or(Value::Null))
}

impl Conn for PgConn<'_, '_> {
    fn postgres(&self) -> bool {
        true
    }

    fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        Ok(self.0.batch_execute(sql)?)
    }

    fn execute(&mut self, sql: &str, values: &[Value]) -> Result<u64, StoreError> {
        let params: Vec<&(dyn postgres::types::ToSql + Sync)> = values.iter().map(|v| v as _).collect();
        Ok(self.0.execute(pg_sql(sql).as_str(), &params)?)
    }

    fn query(&mut self, sql: &str, values: &[Value]) -> Result<Vec<Row>, StoreError> {
        let params: Vec<&(dyn postgres::types::ToSql + Sync)> = values.iter().map(|v| v as _).collect();
        let rows = self.0.query(pg_sql(sql).as_str(), &params)?;
        rows.iter().map(|row| (0..row.len()).map(|i| from_pg(row, i)).collect::<Result<Vec<_>, _>>().map(Row)).collect()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn placeholders_become_postgres_ones() {
        assert_eq!(
            super::pg_sql("a = ?1 AND (?2 IS NULL OR b = ?2) LIMIT ?10"),
            "a = $1 AND ($2 IS NULL OR b = $2) LIMIT $10"
        );
    }
}
